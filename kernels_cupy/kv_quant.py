"""The int8 KV cache layout (``--kv-cache-dtype int8``): symmetric int8 per token and per KV head.

Each cached K (or V) vector of one token and one KV head is stored as D int8 codes followed by its fp32 scale
in the same row, so an int8 cache keeps the paged layout and the backend interface of the fp32/bf16 caches
(dim 0 is still the block, dim 1 the slot in the block) and a block's scales travel with its codes:

    cache: (NB, BS, Hkv, D + 4) int8
      [..., :D]   codes c = round(x / s), clamped to [-127, 127]
      [..., D:]   s = max|x| / 127 as the 4 bytes of one native-endian fp32 (0 for an all-zero vector)
    x ~= c * s

A row is D + 4 bytes where fp32 takes 4 D: 68 against 256 bytes at D = 64 (3.8x the tokens per byte).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per (token, KV head) row
QMAX = 127.0


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for this head size and cache dtype."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) row of K or V takes in the cache, scales included."""
    return row_width(head_dim, dtype) * dtype.itemsize


def quantize(x: torch.Tensor) -> torch.Tensor:  # (..., D) float -> (..., D + 4) int8
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # (..., 1)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = (xf * inv).round_().clamp_(-QMAX, QMAX).to(torch.int8)  # (..., D)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # (..., D + 4) -> (..., D)
    d = q.shape[-1] - SCALE_BYTES
    # view(float32) needs the 4 scale bytes contiguous and 4-aligned: true of a cache or a gather of one.
    scale = q[..., d:].contiguous().view(torch.float32)  # (..., 1)
    return (q[..., :d].to(torch.float32) * scale).to(dtype)


def widen(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache (or about to be written to one) in the compute dtype: int8 rows de-quantized."""
    return dequantize(cache_rows, dtype) if is_quantized(cache_rows) else cache_rows.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Fresh K/V (..., D) rounded exactly as the cache stores them, in x's dtype: what a later read sees."""
    if cache_dtype == torch.int8:
        return dequantize(quantize(x), x.dtype)
    return x.to(cache_dtype).to(x.dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Fresh K/V (..., D) in the cache's storage form: (..., D + 4) int8 for an int8 cache."""
    return quantize(x) if cache_dtype == torch.int8 else x.to(cache_dtype)
