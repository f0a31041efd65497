"""The CPU attention backend: the torch reference with decodes routed to the C++ paged kernel."""

from __future__ import annotations

from typing import Any

import torch

from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend


# A chunk of at most this many query rows over a cached context (a speculative verify step: 1 + K rows) runs
# as that many decode rows through the kernel, row j seeing the context up to and including itself; longer
# chunks go through the reference's gather + SDPA, which costs ~0.5 ms a layer in masks and copies.
SHORT_CHUNK_ROWS = 16


# Cache dtypes the C++ kernels both write (write_kv) and read (paged_decode).
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _kernel_reads(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The paged kernel takes fp32 queries over fp32, bf16 or int8 K/V; anything else runs the reference."""
    return q.dtype == torch.float32 and k_cache.dtype in KERNEL_CACHE_DTYPES


def chunk_as_decode_rows(block_table: torch.Tensor, seq_len: int, qlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``qlen`` query rows of a sequence of ``seq_len`` tokens as that many decode rows, causal by
    construction: row j sees the first seq_len - qlen + j + 1 positions. block_table (max_blocks,) ->
    tables (qlen, max_blocks) int32, lens (qlen,) int32."""
    lens = torch.arange(seq_len - qlen + 1, seq_len + 1, dtype=torch.int32)
    return block_table[None, :].expand(qlen, -1), lens


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, module: Any) -> None:
        self._mod = module

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """(T, Hkv, D) rows into their slots: the kernel for fp32 rows into fp32, bf16 or int8 caches (rounded
        as kv_quant rounds them), the reference otherwise."""
        if k_cache.dtype not in KERNEL_CACHE_DTYPES or key.dtype != torch.float32:
            return super().write_kv(key, value, k_cache, v_cache, meta)
        self._mod.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return None

    def _decode(
        self,
        q: torch.Tensor,  # (nd, Hq, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D), or (NB, BS, Hkv, D + 4) int8 (kernels_cupy.kv_quant)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (nd, Hq, D)
        if not _kernel_reads(q, k_cache):
            return super()._decode(q, k_cache, v_cache, meta, scale)
        nd = q.shape[0]
        out: torch.Tensor = self._mod.paged_decode(q.contiguous(), k_cache, v_cache,
                                                   meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        return out

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,  # type: ignore[override]
                 block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        """q (qlen, Hq, D), block_table (max_blocks,) -> (qlen, Hq, D): the reference's contract."""
        qlen = q.shape[0]
        if qlen > SHORT_CHUNK_ROWS or not _kernel_reads(q, k_cache):
            return TorchAttentionBackend._prefill(q, k_cache, v_cache, block_table, seq_len, scale)
        tables, lens = chunk_as_decode_rows(block_table, seq_len, qlen)
        out: torch.Tensor = self._mod.paged_decode(q.contiguous(), k_cache, v_cache, tables.contiguous(), lens, scale)
        return out
