"""Our linear-layer interface and its implementations, chosen by ``--quantization``.

Every projection of the model (q/k/v, o, gate/up, down, lm_head) is a module mapping (T, in) -> (T, out):
:class:`DenseLinear` for ``none`` (fp32 weights), :class:`BlockLinear` for the block modes (weights in GGUF
blocks of 32, 4 or 8 bits). Both run our C++ kernels (``kernels_cupy/cpu/qgemm``), whose result for a row
never depends on how many rows share the call, on the thread count or on the split of the output columns:
each output element is summed in one fixed order (the kernels' headers state it). That is what makes a
request's tokens and logprobs independent of its batch, its chunking and prefix-cache hits; there is no
"dense fp32 above N rows" switch, every M runs the same arithmetic. Where the kernel cannot be had they run
their reference (fp32 ``F.linear``, torch's BLAS), which is not batch-invariant: the worker logs it.

Modes (weights x activations):
- ``int4`` / ``int8``: the weights' own blocks, activations quantized per row and block of 32 to 12-bit
  integer codes held in int16 (the "A16" kernel: AVX2 ``vpmaddwd``, AVX-512 VNNI ``vpdpwssd``, AMX tiles). The
  activation rounding (2^-12 of a block's largest value) is far below the weights' own: these modes answer as
  fp32 of the same weights does (bench/quality.py: top-1 agreement and perplexity in bench/RESULTS.md). 12 bits,
  not 16: on AMX a 4-bit block then takes one tile product instead of two (qgemm_a16_amx.h).
- ``int4-a8`` / ``int8-a8``: activations at 8 bits per block (llama.cpp's Q8_1 numerics): fewer integer
  operations, lower agreement with fp32 of the same weights. Available by name, never picked by ``auto``.
- ``none``: fp32 weights (a GGUF de-quantized once), the fixed-order fp32 kernel (``flinear``).

Weight rules: ``int4*`` keeps GGUF Q4_0/Q4_1/Q8_0 blocks as they are (the head of a GGUF stays at its own
width), other weights are quantized to Q4_1, the head to Q8_0 (the most sensitive layer). ``int8*`` keeps
GGUF Q8_0 blocks, everything else (4-bit blocks de-quantized, fp32 weights) to Q8_0.
``auto``: ``none`` where the kernel has no SIMD path here (the scalar path loses to fp32); otherwise the
GGUF's own width (``int4`` for a Q4 file, as llama.cpp runs it), ``int8`` for fp32/bf16 checkpoints.
fbgemm's prepacked dynamic int8 GEMM is not used: its per-tensor 7-bit activations raised SmolLM2's
perplexity from 21.1 to 36.6 on bench/data/quality_text.txt (bench/RESULTS.md), and it is not batch-invariant.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.quant import QK, BlockWeight, dequantize, quantize

log = logging.getLogger(__name__)
MODES = ("auto", "none", "int8", "int4", "int8-a8", "int4-a8")


def mode_bits(mode: str) -> tuple[int, int]:
    """(weight bits, activation bits) of a block mode: ``int4`` -> (4, 16), ``int4-a8`` -> (4, 8)."""
    if mode not in MODES[2:]:
        raise ValueError(f"{mode!r} is not a block mode (block modes: {MODES[2:]})")
    return (4 if mode.startswith("int4") else 8), (8 if mode.endswith("-a8") else 16)


class DenseLinear(nn.Module):
    """y = x @ W^T (+ b) over fp32 weights through the fixed-order fp32 kernel (``flinear``): the ``none``
    mode. Holds the same weight tensor as the nn.Linear it replaces (a tied head stays tied, nothing copied)."""

    def __init__(self, old: nn.Linear, kernel: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = old.in_features, old.out_features
        self.weight = old.weight  # (out, in) fp32
        self.bias = old.bias  # (out,) fp32 or None
        self._kernel: Any = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out) fp32
        b = None if self.bias is None else self.bias.detach()
        out: torch.Tensor = self._kernel.flinear(x.float().contiguous(), self.weight.detach(), b)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fixed-order fp32"


class BlockLinear(nn.Module):
    """y = x @ W^T (+ b) with W in blocks of 32; activations are quantized per row and block inside the
    kernel (12-bit codes by default, 8-bit in the ``-a8`` modes)."""

    codes: torch.Tensor  # (out, in/2) uint8 or (out, in) int8; packed in lane order where wlanes
    d: torch.Tensor  # (out, in/32) fp16: a decode step is bound by bytes read, and GGUF's scales are fp16
    m: torch.Tensor | None  # (out, in/32) fp16, 4-bit only
    mt: torch.Tensor | None  # (in/32, out) fp16, m transposed: 4-bit weights with 8-bit activations only
    bias: torch.Tensor | None  # (out,) fp32
    dense: torch.Tensor | None  # (out, in) fp32, only without the kernel

    def __init__(self, w: BlockWeight, bias: torch.Tensor | None, kernel: Any | None, act_bits: int = 16) -> None:
        super().__init__()
        if act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 8 or 16, got {act_bits}")
        self.bits, self.act_bits = w.bits, act_bits
        self.out_features, self.in_features = w.shape
        # Codes on the A16 kernel's AVX2 and VNNI paths are packed once here (qgemm_core.h, pack_lanes_q4 / _q8): a
        # decode call then widens each weight group without transposing it first (Zen 1, a model's 120 4-bit
        # linears from memory: one row 1.16x, two 1.23x, three 1.29x; Zen 4, one row in cache: Q4 1.3x, Q8 1.5x;
        # bench/RESULTS.md). The same results; AMX, whose tiles read the GGUF's order, keeps it.
        self.wlanes = act_bits == 16 and kernel is not None and bool(kernel.packed_codes_ok())
        codes = w.codes
        if self.wlanes and kernel is not None:
            codes = kernel.pack_lanes(codes.contiguous(), self.in_features)
        self.register_buffer("codes", codes)
        # fp16 is exact: BlockWeight scales are fp16-representable (quant.py).
        self.register_buffer("d", w.d.half())
        self.register_buffer("m", None if w.m is None else w.m.half())
        # (in/32, out) fp16: the A8 kernel adds the min terms of eight output columns per load from these
        # (qgemm_impl.h); the A16 kernel reads the minimums of eight blocks of a row from m instead.
        a8_mins = kernel is not None and act_bits == 8
        self.register_buffer("mt", w.m.half().t().contiguous() if w.m is not None and a8_mins else None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._kernel: Any = kernel
        # Without the kernel: the reference, fp32 weights de-quantized once.
        self.register_buffer("dense", None if kernel is not None else dequantize(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out) fp32
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        out: torch.Tensor = self._kernel.qlinear(x.float(), self.codes, self.d, self.m, self.bias, self.bits,
                                                 self.mt, self.act_bits, self.wlanes)
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, act_bits={self.act_bits}, "
                f"kernel={self.dense is None}, packed={self.wlanes}")


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


def _target(name: str, wbits: int, gguf: BlockWeight | None, weight: torch.Tensor) -> BlockWeight:
    """The blocks a layer runs with ``wbits``-bit weights: the GGUF's own where they fit, else quantized."""
    if gguf is not None and (wbits == 4 or gguf.bits == 8):
        return gguf
    if gguf is not None:  # int8 of a 4-bit GGUF layer: its exact fp32 values, re-blocked at 8 bits
        return quantize(dequantize(gguf), 8)
    bits = 8 if wbits == 8 or name == "lm_head" else 4
    return quantize(weight, bits)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def dense_linears(model: nn.Module, kernel: Any | None) -> int:
    """Every fp32 CPU ``nn.Linear`` left in the model -> :class:`DenseLinear` (the fixed-order kernel), in
    place; returns how many. Without the kernel nothing changes: torch's BLAS runs."""
    if kernel is None:
        return 0
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
             and m.weight.device.type == "cpu"]
    for name in names:
        _swap(model, name, DenseLinear(model.get_submodule(name), kernel))  # type: ignore[arg-type]
    return len(names)


def quantize_linears(model: nn.Module, mode: str, gguf_blocks: dict[str, BlockWeight],
                     kernel: Any | None) -> int:
    """Swap the model's projections for BlockLinears (block modes) and the rest for DenseLinears (in place);
    returns how many became BlockLinears."""
    if mode == "none":
        dense_linears(model, kernel)
        return 0
    wbits, abits = mode_bits(mode)
    # Blocks run along the input dimension: a layer whose width is not a multiple of 32 stays fp32.
    # (DenseLinears too: a model built as ``none`` can be re-quantized, as tests and benchmarks do.)
    names = [n for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, DenseLinear)) and m.in_features % QK == 0]
    kept = 0
    for name in names:
        old = model.get_submodule(name)
        weight: torch.Tensor = old.weight  # type: ignore[assignment]  # (out, in) fp32
        bias: torch.Tensor | None = old.bias  # type: ignore[assignment]
        blocks = _target(name, wbits, gguf_blocks.get(name), weight)
        if blocks.shape != tuple(weight.shape):
            raise ValueError(f"{name}: GGUF blocks {blocks.shape} do not match the weight {tuple(weight.shape)}")
        kept += blocks is gguf_blocks.get(name)
        _swap(model, name, BlockLinear(blocks, bias, kernel, abits))
    dense = dense_linears(model, kernel)
    log.info("quantization %s: %d linear layers in blocks (%d the GGUF's own), %d fp32, kernel path %s",
             mode, len(names), kept, dense, kernel_isa(kernel))
    return len(names)
