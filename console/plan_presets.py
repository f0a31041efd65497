"""Presets for ``kvgatectl plan``: devices (memory, bandwidth), dtype sizes, and model shapes by name.

Memory is what ``nvidia-smi`` reports as total for the board (MiB), not the marketing GB; bandwidth is the
vendor's peak HBM/GDDR figure. A real decode step reaches perhaps 60-85% of peak, so the planner's tokens/s is
an upper bound, as the seeds' worksheet says.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float  # peak memory bandwidth
    note: str = ""


DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("NVIDIA H100 SXM 80GB", 81559 * MIB, 3.35e12, "HBM3"),
    "h100-pcie": DeviceSpec("NVIDIA H100 PCIe 80GB", 81559 * MIB, 2.0e12, "HBM2e"),
    "h200": DeviceSpec("NVIDIA H200 141GB", 143771 * MIB, 4.8e12, "HBM3e"),
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB", 40960 * MIB, 1.555e12, "HBM2"),
    "a100-80gb": DeviceSpec("NVIDIA A100 80GB SXM", 81920 * MIB, 2.039e12, "HBM2e"),
    "l4": DeviceSpec("NVIDIA L4 24GB", 23034 * MIB, 300e9, "GDDR6"),
    "a10g": DeviceSpec("NVIDIA A10G 24GB", 23028 * MIB, 600e9, "GDDR6"),
    "rtx-4090": DeviceSpec("NVIDIA GeForce RTX 4090 24GB", 24564 * MIB, 1008e9, "GDDR6X"),
}
DEVICE_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "4090": "rtx-4090"}

# Bytes per weight. int8/int4 are our GGUF-style blocks of 32 with an fp16 scale (Q8_0: 34 B, Q4_0: 18 B per
# 32 weights), so the scales are counted, not waved away.
WEIGHT_DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 34 / 32, "int4": 18 / 32}
# Bytes per cached K or V element. fp8 per-tensor scales are a few bytes per layer: not counted. kvgate's int8
# cache keeps an fp32 scale per token and KV head (kernels_cupy/kv_quant.py): 4 bytes per row of head_dim codes.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
KV_ROW_SCALE_BYTES: dict[str, int] = {"int8": 4}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "auto": "fp16"}


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs from a model. ``params`` counts every weight (embeddings and lm_head
    included: a decode step reads the lm_head; the embedding rows it reads are few but they take memory)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    max_position_embeddings: int
    params: int = 0  # 0: computed from the shape (Llama family layout)

    def param_count(self) -> int:
        if self.params:
            return self.params
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        return self.num_layers * per_layer + embed + h + (0 if self.tied_embeddings else embed)


def _llama(name: str, layers: int, heads: int, kv_heads: int, hidden: int, inter: int, vocab: int,
           ctx: int, tied: bool = False) -> ModelShape:
    return ModelShape(name, layers, heads, kv_heads, hidden // heads, hidden, inter, vocab, tied, ctx)


# Shapes from the models' config.json files (Hugging Face); for planning when the files are not at hand.
MODELS: dict[str, ModelShape] = {
    "llama-2-7b": _llama("Llama-2-7B", 32, 32, 32, 4096, 11008, 32000, 4096),
    "llama-2-13b": _llama("Llama-2-13B", 40, 40, 40, 5120, 13824, 32000, 4096),
    "llama-3-8b": _llama("Llama-3-8B", 32, 32, 8, 4096, 14336, 128256, 8192),
    "llama-3-70b": _llama("Llama-3-70B", 80, 64, 8, 8192, 28672, 128256, 8192),
    "mistral-7b": _llama("Mistral-7B", 32, 32, 8, 4096, 14336, 32000, 32768),
    "qwen2.5-7b": _llama("Qwen2.5-7B", 28, 28, 4, 3584, 18944, 152064, 32768),
}


def device_names() -> list[str]:
    return sorted(DEVICES) + ["this-machine"]


def canonical_dtype(value: str, table: dict[str, float] | dict[str, int], what: str) -> str:
    key = DTYPE_ALIASES.get(value.lower(), value.lower())
    if key not in table:
        raise ValueError(f"unknown {what} dtype {value!r}: one of {', '.join(table)}")
    return key
