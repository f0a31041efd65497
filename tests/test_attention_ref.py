"""The torch paged-attention reference against plain dense attention on contiguous K/V."""

from __future__ import annotations

import torch

from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    # q (n, Hq, D) at positions offset..offset+n-1; k, v (L, Hkv, D) -> (n, Hq, D)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + offset)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_mixed_batch_with_shared_and_scattered_blocks() -> None:
    torch.manual_seed(0)
    nb, bs, hq, hkv, d = 40, 4, 6, 2, 8
    kc, vc = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    # (context length, new tokens) per sequence: two decodes first, then prefill chunks with cached prefixes.
    seqs = [(9, 1), (1, 1), (13, 5), (7, 7), (16, 3)]
    perm = torch.randperm(nb).tolist()
    tables, full_k, full_v = [], [], []
    for i, (L, _) in enumerate(seqs):
        t = perm[i * 5: i * 5 + -(-L // bs)]
        tables.append(t)
        full_k.append(torch.randn(L, hkv, d))
        full_v.append(torch.randn(L, hkv, d))
    tables[4][:2] = tables[2][:2]  # seq 4 shares its first two blocks with seq 2 (a prefix hit)
    full_k[4][:8], full_v[4][:8] = full_k[2][:8], full_v[2][:8]
    slots, ks, vs, qs = [], [], [], []
    for (L, n), t, k, v in zip(seqs, tables, full_k, full_v):  # cached part written directly
        for p in range(L - n):
            kc[t[p // bs], p % bs], vc[t[p // bs], p % bs] = k[p], v[p]
        slots += [t[p // bs] * bs + p % bs for p in range(L - n, L)]
        ks.append(k[L - n:])
        vs.append(v[L - n:])
        qs.append(torch.randn(n, hq, d))
    maxb = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 1, 2, 7, 14, 17], dtype=torch.int32),
        seq_lens=torch.tensor([L for L, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (maxb - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=tuple(n for _, n in seqs), seq_lens_cpu=tuple(L for L, _ in seqs),
        num_decodes=2, max_seq_len=16)
    be = TorchAttentionBackend()
    be.write_kv(torch.cat(ks), torch.cat(vs), kc, vc, meta)
    out = be.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kc, vc, meta, 0.35)
    rows = 0
    for (L, n), q, k, v in zip(seqs, qs, full_k, full_v):
        torch.testing.assert_close(out[rows:rows + n], dense(q, k, v, L - n, 0.35), atol=1e-5, rtol=1e-5)
        rows += n
