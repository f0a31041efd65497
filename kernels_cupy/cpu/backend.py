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

from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend

# Cache dtypes the C++ kernels both write (write_kv) and read (paged_decode).
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def _kernel_reads(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The paged kernel takes fp32 queries over fp32, bf16 or int8 K/V; anything else runs the reference."""
    return q.dtype == torch.float32 and k_cache.dtype in KERNEL_CACHE_DTYPES


def chunk_as_decode_rows(block_table: torch.Tensor, seq_len: int, qlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``qlen`` query rows of a sequence of ``seq_len`` tokens as that many decode rows, causal by
    construction: row j sees the first seq_len - qlen + j + 1 positions. block_table (max_blocks,) ->
    tables (qlen, max_blocks) int32, lens (qlen,) int32."""
    lens = torch.arange(seq_len - qlen + 1, seq_len + 1, dtype=torch.int32)
    return block_table[None, :].expand(qlen, -1), lens


def step_rows(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of a step as a decode row: its sequence's block table (T, nb) int32, contiguous, cut to
    the blocks the longest context uses, and the context it sees (T,) int32, itself included."""
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # decodes only: the step's own tables
        return meta.block_tables[:nd], meta.seq_lens[:nd]
    nb = -(-max(meta.seq_lens_cpu) // block_size)
    rows = [(meta.block_tables[:nd, :nb], meta.seq_lens[:nd])] if nd else []
    rows += [chunk_as_decode_rows(meta.block_tables[i, :nb], meta.seq_lens_cpu[i], meta.query_lens_cpu[i])
             for i in range(nd, meta.num_seqs)]
    return torch.cat([tables for tables, _ in rows]), torch.cat([lens for _, lens in rows])


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, module: Any) -> None:
        self._mod = module
        # The last step's row tables: every layer of a step attends with the same metadata object.
        self._rows: tuple[AttentionMetadata, int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """(T, Hkv, D) rows into their slots: the kernel for fp32 rows into fp32, bf16 or int8 caches (rounded
        as kv_quant rounds them), the reference otherwise."""
        if k_cache.dtype not in KERNEL_CACHE_DTYPES or key.dtype != torch.float32:
            return super().write_kv(key, value, k_cache, v_cache, meta)
        self._mod.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return None

    def step_rows(self, meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """step_rows, built once a step (the layers share the metadata object)."""
        if self._rows is None or self._rows[0] is not meta or self._rows[1] != block_size:
            self._rows = (meta, block_size, step_rows(meta, block_size))
        return self._rows[2]

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
