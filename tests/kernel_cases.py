"""Paged-attention test cases: caches, block tables and metadata for one engine step, on any device.

Shared by the emulation tests (CPU), the GPU tests and anyone checking a new backend: each case knows every
sequence's full K/V, so it also carries an independent dense reference (float64, no paging) besides the
torch paged reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels_cupy.interface import AttentionMetadata


@dataclass(frozen=True)
class Case:
    query: torch.Tensor  # (T, Hq, D)
    key: torch.Tensor  # (T, Hkv, D) this step's new K (maybe a strided view of a fused qkv buffer)
    value: torch.Tensor  # (T, Hkv, D)
    k_cache: torch.Tensor  # (NB, BS, Hkv, D) holding every sequence's cached (not new) tokens
    v_cache: torch.Tensor  # (NB, BS, Hkv, D)
    meta: AttentionMetadata
    full_k: tuple[torch.Tensor, ...]  # per sequence (L, Hkv, D): cached + new
    full_v: tuple[torch.Tensor, ...]
    scale: float


def _block_ids(seqs: Sequence[tuple[int, int]], block_size: int, spare: int, gen: torch.Generator,
               share: Sequence[tuple[int, int, int]]) -> list[list[int]]:
    """Scattered (non-contiguous, shuffled) physical block ids per sequence; ``share`` makes sequence dst
    point at the first n blocks of sequence src, as a prefix-cache hit does."""
    counts = [-(-ctx // block_size) for ctx, _ in seqs]
    perm = torch.randperm(sum(counts) + spare, generator=gen).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(perm[at:at + c])
        at += c
    for dst, src, n in share:
        for i in (dst, src):  # a shared block must be full and cached, not written this step
            ctx, new = seqs[i]
            if n * block_size > ctx - new:
                raise ValueError(f"sequence {i}: {n} shared blocks exceed its {ctx - new} cached tokens")
        tables[dst][:n] = tables[src][:n]
    return tables


def build_case(
    seqs: Sequence[tuple[int, int]],  # per sequence (context length after the step, new tokens); decodes first
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    share: Sequence[tuple[int, int, int]] = (),  # (dst seq, src seq, blocks): dst reuses src's first blocks
    spare_blocks: int = 3,
    fill: float = 0.0,  # value of never-written cache slots; NaN proves a backend never reads them
    fused_qkv: bool = False,  # query/key/value as strided views of one (T, Hq + 2 Hkv, D) buffer
) -> Case:
    if any(new < 1 or new > ctx for ctx, new in seqs):
        raise ValueError(f"need 1 <= new tokens <= context for every sequence, got {list(seqs)}")
    gen = torch.Generator().manual_seed(seed)
    tables = _block_ids(seqs, block_size, spare_blocks, gen, share)
    full_k = [torch.randn(ctx, num_kv_heads, head_dim, generator=gen) for ctx, _ in seqs]
    full_v = [torch.randn(ctx, num_kv_heads, head_dim, generator=gen) for ctx, _ in seqs]
    for dst, src, n in share:  # shared blocks hold the same tokens for both sequences
        full_k[dst][:n * block_size] = full_k[src][:n * block_size]
        full_v[dst][:n * block_size] = full_v[src][:n * block_size]
    full_k = [k.to(dtype) for k in full_k]
    full_v = [v.to(dtype) for v in full_v]

    num_blocks = max(max(t) for t in tables) + 1 + spare_blocks
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    slots: list[torch.Tensor] = []
    for (ctx, new), table, k, v in zip(seqs, tables, full_k, full_v):
        pos = torch.arange(ctx)
        flat_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size  # (ctx,)
        k_cache.view(-1, num_kv_heads, head_dim)[flat_slots[:ctx - new]] = k[:ctx - new]
        v_cache.view(-1, num_kv_heads, head_dim)[flat_slots[:ctx - new]] = v[:ctx - new]
        slots.append(flat_slots[ctx - new:])

    total = sum(new for _, new in seqs)
    q = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([k[ctx - new:] for (ctx, new), k in zip(seqs, full_k)])
    value = torch.cat([v[ctx - new:] for (ctx, new), v in zip(seqs, full_v)])
    if fused_qkv:  # the model's layout: one projection output viewed per head
        fused = torch.cat([q, key, value], dim=1)  # (T, Hq + 2 Hkv, D)
        q, key, value = torch.split(fused, [num_q_heads, num_kv_heads, num_kv_heads], dim=1)

    max_blocks = max(len(t) for t in tables)
    qsl = [0]
    for _, new in seqs:
        qsl.append(qsl[-1] + new)
    nd = next((i for i, (_, new) in enumerate(seqs) if new != 1), len(seqs))
    dev = torch.device(device)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(torch.int64).to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_lens_cpu=tuple(new for _, new in seqs), seq_lens_cpu=tuple(ctx for ctx, _ in seqs),
        num_decodes=nd, max_seq_len=max(ctx for ctx, _ in seqs))
    return Case(q.to(dev), key.to(dev), value.to(dev), k_cache.to(dev), v_cache.to(dev), meta,
                tuple(k.to(dev) for k in full_k), tuple(v.to(dev) for v in full_v), head_dim ** -0.5)


def dense_reference(case: Case) -> torch.Tensor:  # (T, Hq, D) float64
    """Attention from each sequence's full K/V, no paging: row r of a chunk of n new tokens of a context of
    L sees keys at positions <= L - n + r."""
    outs = []
    row = 0
    for (k, v), n in zip(zip(case.full_k, case.full_v), case.meta.query_lens_cpu):
        q = case.query[row:row + n].double()  # (n, Hq, D)
        g = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(g, dim=1)  # (L, Hq, D)
        vv = v.double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * case.scale  # (Hq, n, L)
        ctx = k.shape[0] - n
        visible = torch.arange(k.shape[0], device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + ctx
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        row += n
    return torch.cat(outs)
