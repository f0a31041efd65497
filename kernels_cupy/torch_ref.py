"""Pure-PyTorch paged attention: the CPU path of the engine and the oracle for the CUDA kernels.

Decodes (one query token each) are attended in one batched call over K/V gathered through the block
table and padded to the longest context; prefill chunks are attended one sequence at a time, causal
within the chunk and full over the tokens already in the cache. No padding ever reaches the linear layers.
An int8 cache (``kernels_cupy.kv_quant``: codes and a per-token-per-head scale in each row) is read by
gathering its blocks and de-quantizing the gathered rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.kv_quant import as_cached, to_cache, widen


def gather_kv(
    cache: torch.Tensor,  # (NB, BS, Hkv, D), or (NB, BS, Hkv, D + 4) int8
    block_table: torch.Tensor,  # (nblocks,) or (B, nblocks) int
    length: int,  # tokens to keep (<= nblocks * BS)
) -> torch.Tensor:  # (length, Hkv, D) or (B, length, Hkv, D)
    # index_select on the flattened table copies whole blocks with memcpy: several times faster on the
    # CPU than advanced indexing with a 2-D index.
    lead = block_table.shape[:-1]
    blocks = cache.index_select(0, block_table.reshape(-1).long())  # (B * nblocks, BS, Hkv, D)
    flat = blocks.view(*lead, -1, *cache.shape[2:])  # (..., nblocks * BS, Hkv, D)
    return flat[..., :length, :, :]


class TorchAttentionBackend:
    """Reference implementation of :class:`kernels_cupy.interface.AttentionBackend`."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
    ) -> None:
        # The caches are contiguous, so a flat (NB*BS, Hkv, D) view addresses slots directly; an int8 cache
        # gets each (token, head) row quantized with its own scale.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, to_cache(key, k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, to_cache(value, v_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale)
        start = nd
        for i in range(nd, meta.num_seqs):
            qlen, slen = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            rows = slice(start, start + qlen)
            if qlen == slen:  # nothing cached before this chunk: attend to the fresh K/V, no gather
                # (rounded as the cache stores them, so a later prefix hit sees exactly the same values)
                kr, vr = as_cached(key[rows], k_cache.dtype), as_cached(value[rows], v_cache.dtype)
                out[rows] = self._causal(query[rows], kr, vr, scale)
            else:
                out[rows] = self._prefill(query[rows], k_cache, v_cache, meta.block_tables[i], slen, scale)
            start += qlen
        return out

    def _decode(
        self,
        q: torch.Tensor,  # (nd, Hq, D)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (nd, Hq, D)
        nd = q.shape[0]
        max_len = max(meta.seq_lens_cpu[:nd])
        nblocks = -(-max_len // k_cache.shape[1])
        table = meta.block_tables[:nd, :nblocks]  # (nd, nblocks)
        # K/V are widened to the query's dtype (a bf16 cache under an fp32 model computes in fp32; int8 rows
        # are de-quantized).
        k = widen(gather_kv(k_cache, table, max_len), q.dtype).transpose(1, 2)  # (nd, Hkv, L, D)
        v = widen(gather_kv(v_cache, table, max_len), q.dtype).transpose(1, 2)  # (nd, Hkv, L, D)
        pos = torch.arange(max_len, device=q.device)  # (L,)
        valid = pos[None, :] < meta.seq_lens[:nd, None].to(q.device)  # (nd, L) padding mask
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (nd, Hq, 1, D)
            k,
            v,
            attn_mask=valid[:, None, None, :],  # (nd, 1, 1, L)
            scale=scale,
            enable_gqa=True,
        )  # (nd, Hq, 1, D)
        return o.squeeze(2)

    @staticmethod
    def _causal(
        q: torch.Tensor,  # (n, Hq, D)
        k: torch.Tensor,  # (n, Hkv, D)
        v: torch.Tensor,  # (n, Hkv, D)
        scale: float,
    ) -> torch.Tensor:  # (n, Hq, D)
        # 4-D (a batch of one): given 3-D tensors torch's CPU dispatch takes the math path (masks built and
        # checked op by op); 4-D ones reach its flash kernel, 2.0-2.3x faster for a 256-row chunk.
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1).to(q.dtype)[None],
                                           v.transpose(0, 1).to(q.dtype)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # (qlen, Hq, D)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # (max_blocks,)
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:  # (qlen, Hq, D)
        qlen = q.shape[0]
        nblocks = -(-seq_len // k_cache.shape[1])
        k = widen(gather_kv(k_cache, block_table[:nblocks], seq_len), q.dtype).transpose(0, 1)  # (Hkv, L, D)
        v = widen(gather_kv(v_cache, block_table[:nblocks], seq_len), q.dtype).transpose(0, 1)  # (Hkv, L, D)
        qh = q.transpose(0, 1)  # (Hq, qlen, D)
        # Query row r sits at absolute position (seq_len - qlen + r) and sees keys up to it.
        rows = torch.arange(qlen, device=q.device)[:, None] + (seq_len - qlen)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # (qlen, L)
        o = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale,
                                           enable_gqa=True)  # 4-D: the flash kernel, see _causal
        return o[0].transpose(0, 1)  # (qlen, Hq, D)
