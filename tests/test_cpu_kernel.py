"""The C++ CPU paged-decode kernel against the torch reference (the oracle)."""

from __future__ import annotations

import pytest
import torch

from kernels_cupy import kv_quant
from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend
from tests.cpu_support import built


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from kernels_cupy.cpu import load
    from kernels_cupy.cpu.backend import CpuAttentionBackend

    return CpuAttentionBackend(built(load(), "the CPU kernel"))


def _meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    maxb = max(len(t) for t in tables)
    n = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (maxb - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=(1,) * n, seq_lens_cpu=tuple(lens), num_decodes=n,
        max_seq_len=max(lens))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 16, 8)])
def test_decode_matches_reference(backend, hq: int, hkv: int, d: int, bs: int,  # type: ignore[no-untyped-def]
                                  kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hq * 100 + d)
    nb = 64
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(kv_dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(kv_dtype)
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 7 * bs]
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for L in lens:
        n = -(-L // bs)
        tables.append(perm[used:used + n])
        used += n
    tables[5][:3] = tables[4][:3]  # shared (prefix-cached) blocks
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = _meta(tables, lens)
    ref = TorchAttentionBackend()._decode(q, kc, vc, meta, d ** -0.5)
    got = backend._decode(q, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def test_bf16_queries_fall_back_to_reference(backend) -> None:  # type: ignore[no-untyped-def]
    kc = torch.randn(4, 4, 1, 8, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 8, dtype=torch.bfloat16)
    meta = _meta([[2, 1]], [6])
    torch.testing.assert_close(backend._decode(q, kc, kc, meta, 0.3),
                               TorchAttentionBackend()._decode(q, kc, kc, meta, 0.3))


@pytest.mark.parametrize("isa", ["scalar", "auto"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,lens", [(4, 1, [1000]), (9, 3, [300]), (4, 1, [1000, 1]), (2, 1, [130, 7])])
def test_few_long_sequences_split_the_context_and_merge_exactly(backend, hq: int, hkv: int,  # type: ignore[no-untyped-def]
                                                                lens: list[int], kv_dtype: torch.dtype,
                                                                isa: str) -> None:
    """Fewer (sequence, KV head) items than twice the threads: the kernel splits each context into chunks and
    merges them by their max and sum (including a chunk left empty by a 1-token context). Both bodies: the
    portable loops ("scalar") and, where built, the AVX2 one ("auto")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # 8 items wanted: every case here splits
    backend._mod.set_kv_isa(isa)
    try:
        g = torch.Generator().manual_seed(sum(lens) + hq)
        d, bs = 32, 16
        nb = sum(-(-L // bs) for L in lens) + 1
        kc = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(kv_dtype)
        vc = torch.randn(nb, bs, hkv, d, generator=g).to(kv_dtype)
        perm = torch.randperm(nb, generator=g).tolist()
        tables, used = [], 0
        for L in lens:
            tables.append(perm[used:used + -(-L // bs)])
            used += len(tables[-1])
        q = torch.randn(len(lens), hq, d, generator=g)
        meta = _meta(tables, lens)
        ref = TorchAttentionBackend()._decode(q, kc, vc, meta, d ** -0.5)
        got = backend._decode(q, kc, vc, meta, d ** -0.5)
    finally:
        torch.set_num_threads(threads)
        backend._mod.set_kv_isa("auto")
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("qlen,cached", [(1, 7), (5, 40), (16, 3), (17, 30)])
def test_short_chunks_over_a_cached_context_match_the_reference(backend, qlen: int, cached: int,  # type: ignore[no-untyped-def]
                                                                kv_dtype: torch.dtype) -> None:
    """A speculative verify step (1 + K query rows after a cached context) runs as decode rows through the
    kernel: causal, each row up to itself; 17 rows take the reference path (the same answer)."""
    from kernels_cupy.cpu.backend import SHORT_CHUNK_ROWS

    assert SHORT_CHUNK_ROWS == 16
    g = torch.Generator().manual_seed(qlen * 100 + cached)
    hq, hkv, d, bs, nb = 6, 2, 32, 4, 32
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    if kv_dtype == torch.int8:
        kc, vc = kv_quant.quantize(kc), kv_quant.quantize(vc)
    seq_len = cached + qlen
    table = torch.randperm(nb, generator=g)[: -(-seq_len // bs)].to(torch.int32)
    q = torch.randn(qlen, hq, d, generator=g)
    ref = TorchAttentionBackend._prefill(q, kc, vc, table, seq_len, d ** -0.5)
    got = backend._prefill(q, kc, vc, table, seq_len, d ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def test_write_kv_matches_the_reference_from_strided_rows(backend) -> None:  # type: ignore[no-untyped-def]
    """K/V arrive as views of the fused qkv projection (rows strided); the kernel writes fp32, bf16 and int8
    caches (kv_quant's layout, D codes then the fp32 scale) byte for byte as the reference does, an all-zero
    row (scale 0) and values at a rounding tie included; a slot past the cache is refused."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, nb, bs = 5, 6, 2, 8, 6, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    _, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(t, hkv, d), v.view(t, hkv, d)
    meta = _meta([[0, 1, 2, 3, 4, 5]], [t])
    meta = AttentionMetadata(torch.tensor([3, 9, 10, 17, 0]), meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             meta.query_lens_cpu, meta.seq_lens_cpu, 0, meta.max_seq_len)
    k[1, 0] = 0.0  # scale 0: codes 0, no division by zero
    v[2, 1] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5, -63.5, 3.0, 0.25])  # scale 1: ties round to even
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        w = kv_quant.row_width(d, dtype)
        caches = [torch.zeros(nb, bs, hkv, w, dtype=dtype) for _ in range(4)]
        backend.write_kv(k, v, caches[0], caches[1], meta)
        TorchAttentionBackend().write_kv(k, v, caches[2], caches[3], meta)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), dtype
        assert caches[0].float().abs().sum() > 0
    bad = AttentionMetadata(torch.tensor([3, 9, 10, 17, nb * bs]), meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0, meta.max_seq_len)
    with pytest.raises(RuntimeError, match="slot out of range"):
        backend.write_kv(k, v, torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d), bad)
