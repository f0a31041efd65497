"""Load weights into our Llama modules (see ``workers.model_files`` for where files come from). GGUF files
are dequantized once by transformers into safetensors; nothing is ever unpickled."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from common.model_files import write_source
from workers.config import ModelConfig
from workers.models.llama import LlamaConfig, LlamaForCausalLM, Rotary

log = logging.getLogger(__name__)

SUPPORTED_TYPES = {"llama", "mistral", "qwen2"}


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF (transformers + gguf) into a safetensors directory at ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (one time)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
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
    write_source(tmp, gguf)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


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
    if sd is None:
        model = LlamaForCausalLM(cfg, max_len)
    else:
        model = _uninitialized(cfg, max_len)
        missing, unexpected = model.load_state_dict(fuse_hf_weights(sd, cfg), strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.to(device=device, dtype=dtype)
    # Rope tables stay fp32 (built after the cast, so they never pass through a lower precision).
    model.rotary = Rotary(cfg, max_len).to(device)
    if device.type == "cpu" and dtype == torch.float32:  # the fused C++ ops run fp32 on the CPU only
        from kernels_cupy.cpu.fused import load_fused
        from workers.models.fused import FusedOps

        model.ops = FusedOps(load_fused())
        if model.ops.kernel is not None:  # the stack runs the fused ops' kernels: both or neither
            from kernels_cupy.cpu.stack import load_stack

            model.stack_kernel = load_stack()
    if device.type == "cuda":
        _batch_invariant_cuda(model, device)
    return model.eval()


def _uninitialized(cfg: LlamaConfig, max_len: int) -> LlamaForCausalLM:
    """The model with storage but no initial values, for weights that are all loaded next: the linears' random
    init was ~1 s of a smollm2 worker's start. The rope tables are rebuilt after the load (``build_model``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_len)
    # Module.to_empty, but with torch.empty: empty_like of a meta tensor goes through torch._refs, which imports
    # torch.fx's symbolic shapes and sympy (~0.8 s of a worker's start)
    model._apply(_cpu_storage)  # type: ignore[no-untyped-call]  # what to_empty calls, untyped in torch
    if cfg.tie_word_embeddings:  # to_empty gives each module a new parameter: the tie is made again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _cpu_storage(t: torch.Tensor) -> torch.Tensor:
    """Uninitialized CPU storage of ``t``'s shape and dtype."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _batch_invariant_cuda(model: LlamaForCausalLM, device: torch.device) -> None:
    """The CUDA model's batch-invariant pieces: GEMMs on fixed row tiles (cuBLAS picks its kernel by shape) and
    RMSNorm through the row kernel (torch's reduction picks its layout by shape); the determinism rule."""
    from kernels_cupy.rows_cuda import cuda_rows_or_none
    from workers.models.cuda_linear import tile_linears
    from workers.models.fused import FusedOps

    tile_linears(model)
    model.ops = FusedOps(None, cuda_rows_or_none(device))


def apply_quantization(model: LlamaForCausalLM, cfg: ModelConfig, gguf: Path | None) -> str:
    """Swap the model's linears for the configured quantized ones (in place); returns the mode that runs
    (``auto`` resolved by the rule in ``workers.models.linear``). ``gguf``: the file the weights came from,
    whose own blocks are kept where they map."""
    from kernels_cupy.cpu.qgemm import load_qgemm
    from workers.models.gguf_blocks import gguf_linear_blocks, layer_bits
    from workers.models.linear import dense_linears, quantize_linears, resolve_mode

    if cfg.dtype != "float32" or cfg.device != "cpu":  # ModelConfig admits only none and auto here
        return "none"
    kernel = load_qgemm()
    if cfg.quantization == "none" or resolve_mode(cfg.quantization, kernel, None) == "none":
        # fp32 weights through the fixed-order kernel (auto on a CPU without a SIMD path: the GGUF need not be read)
        dense_linears(model, kernel)
        return "none"
    blocks = gguf_linear_blocks(gguf, model.cfg) if gguf is not None else {}
    mode = resolve_mode(cfg.quantization, kernel, layer_bits(blocks))
    quantize_linears(model, mode, blocks, kernel)
    return mode
