"""Our linear-layer interface and its quantized implementation, chosen by ``--quantization``.

Every projection of the model (q/k/v, o, gate/up, down, lm_head) is a module mapping (T, in) -> (T, out):
``nn.Linear`` for ``none``, :class:`BlockLinear` for ``int8`` / ``int4``. A BlockLinear holds weights in
GGUF blocks of 32 (4- or 8-bit) and runs the C++ kernel (``kernels_cupy/cpu/qgemm``); where the kernel
cannot be had it runs its reference instead, fp32 ``F.linear`` on the de-quantized weights, so a quantized
mode always works and its tests always have an oracle. fbgemm's prepacked dynamic int8 GEMM was measured
faster from ~8 rows up but is not used: its per-tensor 7-bit activations raised SmolLM2's perplexity from 21.1
to 36.6 on bench/data/quality_text.txt (bench/RESULTS.md).

Mode rules (``resolve_mode``):
- ``int4``: GGUF Q4_0/Q4_1/Q8_0 blocks are kept as they are (the head of a GGUF stays at its own width);
  other weights are quantized to Q4_1, the head to Q8_0 (it is the most sensitive layer).
- ``int8``: GGUF Q8_0 blocks kept; everything else (4-bit blocks de-quantized, fp32 weights) to Q8_0.
- ``auto``: ``none`` where the kernel has no SIMD path here (the scalar path loses to fp32 BLAS);
  otherwise the GGUF's own width (``int4`` for a Q4 file, as llama.cpp runs it), ``int8`` for
  fp32/bf16 checkpoints (near-lossless).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.quant import QK, BlockWeight, dequantize, quantize

log = logging.getLogger(__name__)
MODES = ("auto", "none", "int8", "int4")
# From this many rows (a prefill chunk) a BlockLinear de-quantizes its blocks into a shared fp32 buffer and
# runs torch's fp32 GEMM: there the arithmetic, not the weight bytes, bounds the step, and BLAS's fp32 beats
# the block kernel's int8 dot products by more than the de-quantization costs (bench/RESULTS.md, "Prefill").
# The weights are exactly the blocks' (the mode's reference); activations skip their int8 rounding.
# KVGATE_DENSE_PREFILL_ROWS overrides it (0: never), for benchmarks.
DENSE_MIN_ROWS = int(os.environ.get("KVGATE_DENSE_PREFILL_ROWS", "96"))


class _Scratch:
    """One fp32 buffer shared by every BlockLinear of the process (one engine thread runs the model): the
    largest de-quantized weight, not a dense copy of the model."""

    buf = torch.empty(0)

    @classmethod
    def at_least(cls, n: int) -> torch.Tensor:
        if cls.buf.numel() < n:
            cls.buf = torch.empty(n)
        return cls.buf


class BlockLinear(nn.Module):
    """y = x @ W^T (+ b) with W in blocks of 32; activations are quantized per row and block inside the
    kernel (int8, like llama.cpp), so the result is within a small tolerance of the fp32 reference."""

    codes: torch.Tensor  # (out, in/2) uint8 or (out, in) int8
    d: torch.Tensor  # (out, in/32) fp16: a decode step is bound by bytes read, and GGUF's scales are fp16
    m: torch.Tensor | None  # (out, in/32) fp16, 4-bit only
    mt: torch.Tensor | None  # (in/32, out) fp16, m transposed, 4-bit with the kernel only
    bias: torch.Tensor | None  # (out,) fp32
    dense: torch.Tensor | None  # (out, in) fp32, only without the kernel

    def __init__(self, w: BlockWeight, bias: torch.Tensor | None, kernel: Any | None) -> None:
        super().__init__()
        self.bits = w.bits
        self.out_features, self.in_features = w.shape
        self.register_buffer("codes", w.codes)
        # fp16 is exact: BlockWeight scales are fp16-representable (quant.py).
        self.register_buffer("d", w.d.half())
        self.register_buffer("m", None if w.m is None else w.m.half())
        # (in/32, out) fp16: the same minimums transposed, for the kernel's min terms (eight output columns per
        # load instead of a dot product per column; qgemm.cpp). 10% more bytes held, none more read a step.
        self.register_buffer("mt", None if w.m is None or kernel is None else w.m.half().t().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._kernel: Any = kernel
        # Without the kernel: the reference, fp32 weights de-quantized once.
        self.register_buffer("dense", None if kernel is not None else dequantize(w))

    def block_weight(self) -> BlockWeight:
        return BlockWeight(self.bits, self.codes, self.d.float(), None if self.m is None else self.m.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out) fp32
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        if 0 < DENSE_MIN_ROWS <= x.shape[0]:
            w = self._kernel.dequant(self.codes, self.d, self.m, self.bits,
                                     _Scratch.at_least(self.out_features * self.in_features))
            return F.linear(x.float(), w, self.bias)  # (T, in) @ (out, in)^T
        out: torch.Tensor = self._kernel.qlinear(x.float(), self.codes, self.d, self.m, self.bias, self.bits,
                                                 self.mt)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, kernel={self.dense is None}"


def kernel_isa(kernel: Any | None) -> str:
    return "none" if kernel is None else str(kernel.isa())


def resolve_mode(mode: str, kernel: Any | None, gguf_bits: int | None) -> str:
    """``auto`` -> a concrete mode by the rule in the module docstring; other modes pass through."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    if kernel_isa(kernel) in ("none", "scalar"):
        return "none"
    return "int4" if gguf_bits == 4 else "int8"


def _target(name: str, mode: str, gguf: BlockWeight | None, weight: torch.Tensor) -> BlockWeight:
    """The blocks a layer runs in ``mode``: the GGUF's own where they fit the mode, else quantized."""
    if gguf is not None and (mode == "int4" or gguf.bits == 8):
        return gguf
    if gguf is not None:  # int8 of a 4-bit GGUF layer: its exact fp32 values, re-blocked at 8 bits
        return quantize(dequantize(gguf), 8)
    bits = 8 if mode == "int8" or name == "lm_head" else 4
    return quantize(weight, bits)


def quantize_linears(model: nn.Module, mode: str, gguf_blocks: dict[str, BlockWeight],
                     kernel: Any | None) -> int:
    """Swap the model's projections for BlockLinears (in place); returns how many were swapped."""
    if mode == "none":
        return 0
    # Blocks run along the input dimension: a layer whose width is not a multiple of 32 stays fp32.
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % QK == 0]
    kept = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old: nn.Linear = getattr(parent, attr)
        blocks = _target(name, mode, gguf_blocks.get(name), old.weight)
        if blocks.shape != tuple(old.weight.shape):
            raise ValueError(f"{name}: GGUF blocks {blocks.shape} do not match the weight {tuple(old.weight.shape)}")
        kept += blocks is gguf_blocks.get(name)
        setattr(parent, attr, BlockLinear(blocks, old.bias, kernel))
    log.info("quantization %s: %d linear layers in blocks (%d the GGUF's own), kernel path %s",
             mode, len(names), kept, kernel_isa(kernel))
    return len(names)
