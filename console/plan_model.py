"""The model half of ``kvgatectl plan``: a ``ModelShape`` from a preset name, one of our aliases (smollm2), a
GGUF file, or a Hugging Face ``config.json`` (or the directory holding it). Reads metadata only: no torch."""

from __future__ import annotations

import json
from pathlib import Path

from console.plan_presets import MODELS, ModelShape


class PlanInputError(ValueError):
    """Input the planner cannot use (unknown model or device, a file that is not a model)."""


def _gguf_path(name: str) -> Path | None:
    # common.model_files is torch-free and is how the gateway finds the same file; an alias resolves through the
    # installed wheel's metadata, never by importing the wheel.
    from common.model_files import gguf_source

    try:
        return gguf_source(name)
    except ValueError as e:
        raise PlanInputError(str(e)) from None


def shape_from_gguf(path: Path, label: str) -> ModelShape:
    from common.gguf_index import read_index  # not gguf.GGUFReader: it decodes the tokenizer's arrays (seconds)

    try:
        index = read_index(path)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    meta = index.metadata
    arch = meta.get("general.architecture") or "llama"

    def need(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise PlanInputError(f"{path}: GGUF metadata has no {arch}.{key}")
        return int(value)

    heads, hidden = need("attention.head_count"), need("embedding_length")
    key_length = meta.get(f"{arch}.attention.key_length")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = index.array_lengths.get("tokenizer.ggml.tokens")
        if vocab is None:
            raise PlanInputError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    return ModelShape(
        name=label, num_layers=need("block_count"), num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(key_length) if key_length else hidden // heads, hidden_size=hidden,
        intermediate_size=need("feed_forward_length"), vocab_size=int(vocab),
        tied_embeddings="output.weight" not in index.tensors, max_position_embeddings=need("context_length"),
        params=sum(t.n_elements for t in index.tensors.values()))


def shape_from_config(path: Path, label: str) -> ModelShape:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanInputError(f"cannot read {path}: {e}") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise PlanInputError(f"{path} is not a model config")
    try:
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        return ModelShape(
            name=label, num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            params=_safetensors_params(path.parent))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanInputError(f"{path}: not a Llama-family config ({e})") from None


def _safetensors_params(directory: Path) -> int:
    """Exact weight count from the safetensors headers beside the config (0 when there are none)."""
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, meta in header.items():
            if key != "__metadata__":
                count = 1
                for dim in meta["shape"]:
                    count *= int(dim)
                total += count
    return total


def load_shape(model: str) -> ModelShape:
    key = model.lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return shape_from_config(path / "config.json", model)
    if path.name.endswith(".json") and path.is_file():
        return shape_from_config(path, model)
    gguf_file = _gguf_path(model)
    if gguf_file is not None:
        return shape_from_gguf(gguf_file, model)
    raise PlanInputError(f"unknown model {model!r}: a preset ({', '.join(sorted(MODELS))}), smollm2, "
                         "a .gguf file, or a config.json (or its directory)")
