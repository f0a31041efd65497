"""The model of quick drills: a random-weight Llama of a few MB with the default model's tokenizer and chat
template, so a deployment starts in seconds and a drill measures the serving system, not matrix products.

Made once per cache directory (``$KVGATE_CACHE`` or ``~/.cache/kvgate``) and reused; written to a temporary
name and renamed, so two drills starting together never see half a model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

VERSION = 1  # bump when the shape below changes: a new directory, never a stale one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_CACHE") or Path.home() / ".cache" / "kvgate")


def tiny_model_dir() -> Path:
    """The directory of the tiny model, made on first use."""
    path = cache_root() / f"chaos-tiny-v{VERSION}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".chaos-tiny-", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from workers running as another user
    try:
        _build(staging)
        if not path.exists():  # else another drill finished first: keep its copy, drop ours
            os.replace(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


def _build(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model_files import resolve

    torch.manual_seed(VERSION)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_src = resolve("smollm2").directory  # converts the default GGUF once when needed
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists():
            shutil.copy(tokenizer_src / name, path / name)
