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


def as_decode_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """The same step with every query row its own one-token sequence: row r of a sequence whose chunk starts
    at context position c sees keys [0, c + r], through that sequence's block-table row.

    This is how a backend makes a row's attention independent of its step: a prompt row then runs the very
    arithmetic a decode row runs (one kernel, one fixed split of its context), whether it came in a chunk of 16 or
    512, after a prefix-cache hit or not, or as a decode token (kernels_cupy/cupy_backend.py, mode "invariant").
    """
    if meta.num_decodes == meta.num_seqs:
        return meta  # every sequence has one query row already
    row_seq: list[int] = []
    row_len: list[int] = []
    for s, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        row_seq += [s] * qlen
        row_len += range(slen - qlen + 1, slen + 1)
    dev = meta.seq_lens.device
    t = len(row_seq)
    lens = torch.tensor(row_len, dtype=torch.int32).to(dev)  # (T,)
    seqs = torch.tensor(row_seq, dtype=torch.int64).to(dev)  # (T,)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=dev),
        seq_lens=lens,
        block_tables=meta.block_tables.index_select(0, seqs),  # (T, max_blocks)
        query_lens_cpu=(1,) * t,
        seq_lens_cpu=tuple(row_len),
        num_decodes=t,
        max_seq_len=meta.max_seq_len,
    )
