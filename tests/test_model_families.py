"""The model families the README names besides Llama (tests/test_engine_tiny.py), each built tiny with random
weights by transformers, saved as a Hugging Face directory (config.json + model.safetensors), loaded by our engine
the way a worker loads a model (`engine_from_config`) and compared with transformers: greedy tokens and, at every
generated position, the log-probabilities of the top tokens.

- Qwen2: biases on q/k/v (random here: transformers initialises them to zero, which would hide a loader that
  drops them), none on o_proj; tied and untied embeddings.
- Mistral: sliding-window attention is not implemented; the engine caps max_model_len at the window (within it,
  sliding-window attention sees what full attention sees), or refuses an explicit larger --max-model-len.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny import EOS, VOCAB, hf_greedy, random_prompts, run_all
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.engine_build import engine_from_config
from workers.core.scheduler_config import SchedulerConfig

NEW_TOKENS = 12
TOP = 5
WINDOW = 64  # the tiny Mistral's sliding window
_SIZES: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                              rope_theta=10000.0, initializer_range=0.3, bos_token_id=1, eos_token_id=EOS)


def _qwen2(tied: bool) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(11 if tied else 12)
    model: Any = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=tied, rms_norm_eps=1e-6, **_SIZES))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    assert any(name.endswith("q_proj.bias") for name, _ in model.named_parameters())
    assert not any(name.endswith("o_proj.bias") for name, _ in model.named_parameters())
    return model


def _mistral(window: int | None = WINDOW) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(13)
    model: Any = MistralForCausalLM(MistralConfig(sliding_window=window, tie_word_embeddings=False, **_SIZES))
    return model.eval()


def _engine(hf: Any, directory: Path, max_model_len: int | None = None) -> LLMEngine:
    hf.save_pretrained(directory)  # config.json (with model_type) and model.safetensors, as on the Hub
    cfg = EngineConfig(ModelConfig(str(directory), "cpu", "float32", max_model_len, 0),
                       CacheConfig(4, 4096, 0.9, True), SchedulerConfig(32, 64))
    engine, _ = engine_from_config(cfg)
    return engine


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], dict[str, list[Any]]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[Any]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])
    return tokens, logprobs


def _assert_matches_transformers(hf: Any, engine: LLMEngine, prompts: list[list[int]]) -> None:
    tokens, logprobs = _generate(engine, prompts)
    for i, prompt in enumerate(prompts):
        ours = tokens[f"r{i}"]
        assert ours == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt {i} diverged"
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + ours])).logits[0].float(), dim=-1)
        assert len(logprobs[f"r{i}"]) == NEW_TOKENS
        for step, (sampled, top) in enumerate(logprobs[f"r{i}"]):
            row = ref[len(prompt) - 1 + step]
            assert sampled == pytest.approx(row[ours[step]].item(), abs=1e-4)
            ref_top = torch.topk(row, TOP)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen2_matches_transformers(tied: bool, tmp_path: Path) -> None:
    hf = _qwen2(tied)
    engine = _engine(hf, tmp_path)
    assert engine.max_model_len == 2048  # Qwen2's sliding window is off (use_sliding_window: false): no cap
    _assert_matches_transformers(hf, engine, random_prompts(4, 3, 40, seed=21))


def test_mistral_matches_transformers_within_its_window(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = _mistral()
    with caplog.at_level(logging.INFO, logger="workers.engine"):
        engine = _engine(hf, tmp_path)
    assert engine.max_model_len == WINDOW
    assert any(f"capped at the model's sliding_window {WINDOW}" in r.getMessage() for r in caplog.records)
    prompts = random_prompts(4, 3, WINDOW - NEW_TOKENS, seed=22)
    assert max(len(p) for p in prompts) + NEW_TOKENS <= WINDOW
    _assert_matches_transformers(hf, engine, prompts)


def test_mistral_refuses_an_explicit_context_past_its_window(tmp_path: Path) -> None:
    hf = _mistral()
    with pytest.raises(ValueError, match=f"sliding_window {WINDOW}.*--max-model-len {WINDOW} or less"):
        _engine(hf, tmp_path / "past", max_model_len=WINDOW + 1)
    assert _engine(hf, tmp_path / "within", max_model_len=WINDOW // 2).max_model_len == WINDOW // 2
    assert _engine(_mistral(window=None), tmp_path / "no-window").max_model_len == 2048  # v0.2 and later


def test_a_request_past_the_window_is_refused_not_computed_wrongly(tmp_path: Path) -> None:
    engine = _engine(_mistral(), tmp_path)
    engine.add_request("long", random_prompts(1, WINDOW + 1, WINDOW + 1, seed=23)[0],
                       SamplingParams(max_tokens=1, temperature=0.0))
    outs = [o for _ in range(10) if engine.has_unfinished() for o in engine.step()]
    assert outs and outs[-1].finished and outs[-1].error is not None and not outs[-1].new_token_ids
    assert run_all(engine) == {}
