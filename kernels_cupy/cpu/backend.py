"""The CPU attention backend: the torch reference with decodes routed to the C++ paged kernel."""

from __future__ import annotations

from typing import Any

import torch

from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, module: Any) -> None:
        self._mod = module

    def _decode(
        self,
        q: torch.Tensor,  # (nd, Hq, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D), or (NB, BS, Hkv, D + 4) int8 (kernels_cupy.kv_quant)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (nd, Hq, D)
        if q.dtype != torch.float32 or k_cache.dtype not in (torch.float32, torch.bfloat16, torch.int8):
            return super()._decode(q, k_cache, v_cache, meta, scale)  # fp32 queries, fp32/bf16/int8 K/V only
        nd = q.shape[0]
        out: torch.Tensor = self._mod.paged_decode(q.contiguous(), k_cache, v_cache,
                                                   meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        return out
