"""A tiny random-weight Llama saved as a Hugging Face directory (config.json + model.safetensors) with the
default model's tokenizer and chat template, so servers and workers can be tested end to end in seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_tiny_model_dir(path: Path, seed: int = 0, num_layers: int = 2) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model_files import resolve

    src = resolve("smollm2").directory  # tokenizer and template of the default model (vocab 49152)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    d = cfg.to_dict()
    d["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(d))
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(path / "model.safetensors"))
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, path / f)
    return path
