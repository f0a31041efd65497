"""The one attention interface every backend implements.

Shapes used throughout (one engine step):
  T    total tokens scheduled in the step (prefill chunks and decodes, concatenated, no padding)
  B    sequences in the step; the first ``num_decodes`` of them have exactly one query token
  Hq   query heads, Hkv key/value heads (Hq % Hkv == 0, grouped-query attention), D head size
  NB   physical KV blocks, BS tokens per block
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's tokens live in the paged cache for one step; shared by all layers."""

    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot = block_id * BS + offset of each new token
    query_start_loc: torch.Tensor  # (B+1,) int32: sequence i owns query rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # (B,) int32: context length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # (B, max_blocks) int32: physical block ids, 0-padded past seq_lens
    query_lens_cpu: tuple[int, ...]  # (B,) host copy of query lengths, for per-sequence loops
    seq_lens_cpu: tuple[int, ...]  # (B,) host copy of seq_lens
    num_decodes: int  # sequences [0, num_decodes) have query length 1, so they are query rows [0, num_decodes)
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """Paged attention: write the step's K/V through the slot mapping, then attend over block tables."""

    def write_kv(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key: torch.Tensor,  # (T, Hkv, D) this step's K (a backend may attend to it directly, e.g. for a
        value: torch.Tensor,  # (T, Hkv, D)   prefill with nothing cached, instead of re-reading the cache)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding this step's K
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        ...


def chunk_as_decode_rows(block_table: torch.Tensor, seq_len: int, qlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``qlen`` query rows of a sequence of ``seq_len`` tokens as that many decode rows, causal by
    construction: row j sees the first seq_len - qlen + j + 1 positions. block_table (max_blocks,) ->
    tables (qlen, max_blocks) int32, lens (qlen,) int32, on the table's device."""
    lens = torch.arange(seq_len - qlen + 1, seq_len + 1, dtype=torch.int32, device=block_table.device)
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


def as_decode_rows(meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
    """The same step with every query row its own one-token sequence (``step_rows``): row r of a sequence whose
    chunk starts at context position c sees keys [0, c + r], through that sequence's block-table row.

    This is how a backend makes a row's attention independent of its step: a prompt row then runs the very
    arithmetic a decode row runs (one kernel, one fixed split of its context), whether it came in a chunk of 16 or
    512, after a prefix-cache hit or not, or as a decode token (the CPU backend; kernels_cupy/cupy_backend.py, mode
    "invariant").
    """
    if meta.num_decodes == meta.num_seqs:
        return meta  # every sequence has one query row already
    tables, lens = step_rows(meta, block_size)
    row_len = [n for qlen, slen in zip(meta.query_lens_cpu, meta.seq_lens_cpu)
               for n in range(slen - qlen + 1, slen + 1)]  # lens, on the host (the launch plan reads them)
    t = len(row_len)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=lens.device),
        seq_lens=lens,  # (T,)
        block_tables=tables,  # (T, nb)
        query_lens_cpu=(1,) * t,
        seq_lens_cpu=tuple(row_len),
        num_decodes=t,
        max_seq_len=meta.max_seq_len,
    )


class DecodeRows:
    """``as_decode_rows`` built once a step: every layer of a step attends with the same metadata object."""

    def __init__(self) -> None:
        self._last: tuple[AttentionMetadata, int, AttentionMetadata] | None = None

    def of(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        if self._last is None or self._last[0] is not meta or self._last[1] != block_size:
            self._last = (meta, block_size, as_decode_rows(meta, block_size))  # holds meta: its id is not reused
        return self._last[2]
