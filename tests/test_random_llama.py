"""bench/random_llama.py draws the GPU checks' weights on any machine; bench/data/gpu_expect_smollm2.json holds the
CPU `none` tokens for them. The draw must stay what the expectation was made from (else the GPU comparison
compares different models), and the shapes must stay the real models' (a wrong shape would test another model)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.random_llama import SHAPES, checksum, hf_config_dict, state_dict

EXPECT = Path(__file__).resolve().parent.parent / "bench" / "data" / "gpu_expect_smollm2.json"


def test_the_draw_is_the_one_the_expectation_was_made_from() -> None:
    want = json.loads(EXPECT.read_text())
    assert want["shape"] == "smollm2"
    assert checksum(state_dict("smollm2")) == want["checksum"]
    assert all(len(t) == 24 for t in want["tokens"].values())


def test_shapes_match_the_models_they_stand_for() -> None:
    sd = state_dict("smollm2")
    assert sum(t.numel() for t in sd.values()) == 134_515_008  # SmolLM2-135M (tied embeddings)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # 3 KV heads of 64
    cfg = hf_config_dict("llama1b")
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (22, 2048, 4)
    assert set(SHAPES) == {"smollm2", "llama1b"}
