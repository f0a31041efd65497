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
