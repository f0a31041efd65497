"""Block-quantized weights in GGUF's layout (blocks of 32 along the input dimension), and their reference math.

Two formats, the ones the CPU kernel (``kernels_cupy/cpu/qgemm_core.h``) runs:
- ``q4`` (GGUF Q4_1, and Q4_0 mapped onto it with m = -8 d): w = d * code + m, codes 0..15;
- ``q8`` (GGUF Q8_0): w = d * code, codes -127..127.
A GGUF's own blocks are taken as they are (``from_gguf``); other weights are quantized here with
llama.cpp's rounding (``quantize``). ``dequantize`` gives the exact fp32 weights a block set stands for: the
reference model of a quantized mode is the fp32 model with these weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # weights per block


@dataclass(frozen=True)
class BlockWeight:
    """An (N, K) weight in blocks of 32 along K."""

    bits: int  # 4 or 8
    codes: torch.Tensor  # (N, K/2) uint8 nibbles (bits 4) or (N, K) int8 (bits 8)
    d: torch.Tensor  # (N, K/32) fp32 scales, fp16-representable (the kernel reads them as fp16)
    m: torch.Tensor | None  # (N, K/32) fp32 minimums, fp16-representable (bits 4 only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The weight's rows in ``index`` order (q/k rows are permuted between GGUF and HF layouts)."""
        return BlockWeight(self.bits, self.codes[index].contiguous(), self.d[index].contiguous(),
                           None if self.m is None else self.m[index].contiguous())

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight:
        """Stack along N (fusing q/k/v or gate/up); all parts must share a format."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different block formats")
        ms = [p.m for p in parts]
        return BlockWeight(parts[0].bits, torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                           None if any(m is None for m in ms) else torch.cat([m for m in ms if m is not None]))


def _check_k(w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[1] % QK:
        raise ValueError(f"block quantization needs (N, K) with K % {QK} == 0, got {tuple(w.shape)}")


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to fp16 and widened back: GGUF stores scales and minimums as fp16, and so does the kernel."""
    return t.half().float().contiguous()


def quantize(w: torch.Tensor, bits: int) -> BlockWeight:
    """llama.cpp's Q8_0 / Q4_1 quantization of an (N, K) float weight: codes from the fp32 scale, the scale
    (and minimum) then stored at fp16, as llama.cpp does."""
    _check_k(w)
    n, k = w.shape
    b = w.detach().float().reshape(n, k // QK, QK)  # (N, NB, 32)
    if bits == 8:
        d = b.abs().amax(-1) / 127.0  # (N, NB)
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
        return BlockWeight(8, codes, _fp16(d), None)
    if bits == 4:
        lo, hi = b.amin(-1), b.amax(-1)  # (N, NB)
        d = (hi - lo) / 15.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round((b - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)  # (N, NB, 32)
        codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)  # GGUF nibble order
        return BlockWeight(4, codes, _fp16(d), _fp16(lo))
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def dequantize(w: BlockWeight) -> torch.Tensor:  # (N, K) fp32
    n, k = w.shape
    if w.bits == 8:
        return (w.codes.reshape(n, k // QK, QK).float() * w.d[..., None]).reshape(n, k)
    if w.m is None:
        raise ValueError("a 4-bit BlockWeight needs its minimums")
    c = w.codes.reshape(n, k // QK, QK // 2)
    q = torch.cat([c & 0x0F, c >> 4], dim=-1).float()  # (N, NB, 32)
    return (q * w.d[..., None] + w.m[..., None]).reshape(n, k)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, K) fp32
    """What the kernel does to activations (int8 per block of 32, scale amax/127), in fp32: the reference
    for the kernel tests."""
    m, k = x.shape
    b = x.float().reshape(m, k // QK, QK)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(m, k)


# GGUF block layouts, per block: Q8_0 = f16 d, 32 x int8; Q4_0 = f16 d, 16 B; Q4_1 = f16 d, f16 m, 16 B.
GGUF_LAYOUTS = {"Q8_0": (34, 8), "Q4_0": (18, 4), "Q4_1": (20, 4)}


def from_gguf(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """A GGUF tensor's raw blocks (N rows of K/32 blocks, as ``gguf.GGUFReader`` maps them) as a
    BlockWeight, bit for bit the weights llama.cpp runs (f16 scales widened to fp32 exactly)."""
    if type_name not in GGUF_LAYOUTS:
        raise ValueError(f"GGUF type {type_name} has no block mapping (mapped: {sorted(GGUF_LAYOUTS)})")
    size, bits = GGUF_LAYOUTS[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QK, size)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # (N, NB)
    if type_name == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k))
        return BlockWeight(8, codes, d, None)
    if type_name == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return BlockWeight(4, torch.from_numpy(blocks[..., 4:].reshape(n, k // 2).copy()), d, m)
    # Q4_0: w = d * (code - 8) = d * code + (-8 d); -8 d is exact in fp32.
    return BlockWeight(4, torch.from_numpy(blocks[..., 2:].reshape(n, k // 2).copy()), d, -8.0 * d)
