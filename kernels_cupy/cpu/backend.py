"""The CPU attention backend: every query row through the C++ paged kernel as a decode row, the torch reference
for the dtypes the kernel does not read.

A prefill chunk of qlen rows over seq_len positions runs as qlen decode rows (row j sees the first
seq_len - qlen + j + 1 positions), whether its prefix was cached or not and however long it is. The kernel's
result for a row depends only on its query and its context (fixed context chunks merged in a fixed order), so a
prompt token's attention is bit-identical whether it was computed in a cold prefill, in chunks of 16 or 512,
over a prefix-cache hit, as a decode row, next to any other request, on any number of threads.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_cupy.interface import AttentionMetadata, DecodeRows, chunk_as_decode_rows, step_rows
from kernels_cupy.torch_ref import TorchAttentionBackend

__all__ = ["CpuAttentionBackend", "KERNEL_CACHE_DTYPES", "chunk_as_decode_rows", "step_rows"]

# Cache dtypes the C++ kernels both write (write_kv) and read (paged_decode).
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def _kernel_reads(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The paged kernel takes fp32 queries over fp32, bf16 or int8 K/V; anything else runs the reference."""
    return q.dtype == torch.float32 and k_cache.dtype in KERNEL_CACHE_DTYPES


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, module: Any) -> None:
        self._mod = module
        self._rows = DecodeRows()  # the step's row tables, built once a step

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """(T, Hkv, D) rows into their slots: the kernel for fp32 rows into fp32, bf16 or int8 caches (rounded
        as kv_quant rounds them), the reference otherwise."""
        if k_cache.dtype not in KERNEL_CACHE_DTYPES or key.dtype != torch.float32:
            return super().write_kv(key, value, k_cache, v_cache, meta)
        self._mod.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return None

    def step_rows(self, meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """step_rows (kernels_cupy/interface.py), built once a step (the layers share the metadata object)."""
        rows = self._rows.of(meta, block_size)
        return rows.block_tables, rows.seq_lens

    def forward(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key: torch.Tensor,  # (T, Hkv, D), already in the cache: the kernel reads it from there
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, W)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        """Decodes and prefill chunks (any length, cached prefix or not) in one kernel call, as decode rows."""
        if not _kernel_reads(query, k_cache):
            return super().forward(query, key, value, k_cache, v_cache, meta, scale)
        tables, lens = self.step_rows(meta, k_cache.shape[1])
        out: torch.Tensor = self._mod.paged_decode(query.contiguous(), k_cache, v_cache, tables, lens, scale)
        return out
