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


def _attend(backend, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata,  # type: ignore[no-untyped-def]
            scale: float) -> torch.Tensor:
    """The backend's attention over K/V already in the caches (what a layer calls after write_kv)."""
    none = q.new_empty(0)  # the step's fresh K/V rows: read from the cache, never from these
    out: torch.Tensor = backend.forward(q, none, none, kc, vc, meta, scale)
    return out


def _meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    maxb = max(len(t) for t in tables)
    n = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (maxb - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=(1,) * n, seq_lens_cpu=tuple(lens), num_decodes=n,
        max_seq_len=max(lens))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
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
    got = _attend(backend, q, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def test_bf16_queries_fall_back_to_reference(backend) -> None:  # type: ignore[no-untyped-def]
    kc = torch.randn(4, 4, 1, 8, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 8, dtype=torch.bfloat16)
    meta = _meta([[2, 1]], [6])
    torch.testing.assert_close(_attend(backend, q, kc, kc, meta, 0.3),
                               TorchAttentionBackend()._decode(q, kc, kc, meta, 0.3))


def _cache(nb: int, bs: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """(NB, BS, Hkv, W) random cache rows of `dtype` (int8: kv_quant's codes and scales)."""
    return kv_quant.to_cache(torch.randn(nb, bs, hkv, d, generator=g) * 2, dtype)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "auto"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("hq,hkv,lens", [(4, 1, [1000]), (9, 3, [300]), (4, 1, [1000, 1]), (2, 1, [130, 7]),
                                         (8, 2, [128, 129, 256, 257, 511])])
def test_long_contexts_are_chunked_and_merged_exactly(backend, hq: int, hkv: int,  # type: ignore[no-untyped-def]
                                                      lens: list[int], kv_dtype: torch.dtype, isa: str) -> None:
    """Contexts longer than one kernel chunk (cut at fixed positions, partials merged in chunk order), lengths
    on and either side of chunk boundaries, split into work items per chunk or not (few rows, 4 threads): the
    reference's answer. Every body: the portable loops ("scalar") and, where built, the AVX2 and AVX-512 ones
    ("auto" is the widest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    _use_isa(backend, isa)
    try:
        g = torch.Generator().manual_seed(sum(lens) + hq)
        d, bs = 32, 16
        nb = sum(-(-L // bs) for L in lens) + 1
        kc, vc = _cache(nb, bs, hkv, d, kv_dtype, g), _cache(nb, bs, hkv, d, kv_dtype, g)
        perm = torch.randperm(nb, generator=g).tolist()
        tables, used = [], 0
        for L in lens:
            tables.append(perm[used:used + -(-L // bs)])
            used += len(tables[-1])
        q = torch.randn(len(lens), hq, d, generator=g)
        meta = _meta(tables, lens)
        ref = TorchAttentionBackend()._decode(q, kc, vc, meta, d ** -0.5)
        got = _attend(backend, q, kc, vc, meta, d ** -0.5)
    finally:
        torch.set_num_threads(threads)
        backend._mod.set_kv_isa("auto")
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("qlen,cached", [(1, 7), (5, 40), (16, 3), (17, 30), (40, 0), (300, 0), (150, 200)])
def test_chunks_of_any_length_match_the_reference(backend, qlen: int, cached: int,  # type: ignore[no-untyped-def]
                                                  kv_dtype: torch.dtype) -> None:
    """A chunk of query rows (a verify step or a prefill chunk, with or without a cached prefix) runs as decode
    rows through the kernel: causal, each row up to itself, the reference's answer."""
    g = torch.Generator().manual_seed(qlen * 100 + cached)
    hq, hkv, d, bs, nb = 6, 2, 32, 4, 128
    kc, vc = _cache(nb, bs, hkv, d, kv_dtype, g), _cache(nb, bs, hkv, d, kv_dtype, g)
    seq_len = cached + qlen
    table = torch.randperm(nb, generator=g)[: -(-seq_len // bs)].to(torch.int32)
    q = torch.randn(qlen, hq, d, generator=g)
    ref = TorchAttentionBackend._prefill(q, kc, vc, table, seq_len, d ** -0.5)
    got = _attend(backend, q, kc, vc, _step(table.tolist(), bs, cached, seq_len), d ** -0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)  # K of std 2: sharper softmaxes, larger rounding


def _others(n: int, nb: int, bs: int, g: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """n rows of other sequences: random lengths 1..700, random blocks; some runs of consecutive rows of one
    sequence (a prefill chunk's rows, which the kernel groups)."""
    tables, lens = [], []
    while len(lens) < n:
        L = int(torch.randint(1, 700, (1,), generator=g))
        table = torch.randint(0, nb, (-(-(L + 8) // bs),), generator=g).tolist()
        for j in range(min(n - len(lens), int(torch.randint(1, 12, (1,), generator=g)))):
            tables.append(table)
            lens.append(L + j)
    return tables, lens


def _use_isa(backend, isa: str) -> None:  # type: ignore[no-untyped-def]
    """Selects an attention body; skips where this CPU (or its -march=native build) has none of that kind."""
    try:
        backend._mod.set_kv_isa(isa)
    except RuntimeError as e:
        pytest.skip(f"no {isa} body here: {e}")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "auto"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_rows_bits_do_not_depend_on_the_batch_or_threads(backend, kv_dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                                           isa: str) -> None:
    """kvgate's rule: a row's output is bit-identical alone, among 1..64 rows of other sequences (other lengths,
    grouped prefill rows among them), next to the rows of its own prefill chunk, at 1, 2 or 4 threads. "auto" is
    the AVX-512 body where the CPU has one."""
    threads = torch.get_num_threads()
    _use_isa(backend, isa)
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, bs, nb = 9, 3, 64, 16, 400
    kc, vc = _cache(nb, bs, hkv, d, kv_dtype, g), _cache(nb, bs, hkv, d, kv_dtype, g)
    table = torch.randperm(nb, generator=g)[:70].tolist()
    try:
        for L in (1, 100, 128, 300, 1000):
            q = torch.randn(1, hq, d, generator=g)
            torch.set_num_threads(1)
            alone = _attend(backend, q, kc, vc, _meta([table], [L]), 0.125)
            for n_other in (1, 3, 8, 64):
                tables, lens = _others(n_other, nb, bs, g)
                at = int(torch.randint(0, n_other + 1, (1,), generator=g))
                tables.insert(at, table)
                lens.insert(at, L)
                qs = torch.randn(n_other + 1, hq, d, generator=g)
                qs[at] = q[0]
                for t in (1, 2, 4):
                    torch.set_num_threads(t)
                    got = _attend(backend, qs, kc, vc, _meta(tables, lens), 0.125)
                    assert torch.equal(got[at], alone[0]), (L, n_other, t)
            own = [x for x in range(L - 5, L + 4) if x >= 1]  # its prefill chunk: the rows around it
            qs = torch.randn(len(own), hq, d, generator=g)
            qs[own.index(L)] = q[0]
            for t in (1, 2):
                torch.set_num_threads(t)
                got = _attend(backend, qs, kc, vc, _meta([table] * len(own), own), 0.125)
                assert torch.equal(got[own.index(L)], alone[0]), (L, "own chunk", t)
    finally:
        torch.set_num_threads(threads)
        backend._mod.set_kv_isa("auto")


def _step(table: list[int], bs: int, start: int, end: int, decode: tuple[list[int], int] | None = None) -> AttentionMetadata:
    """Metadata of a step computing prompt positions [start, end) of one sequence (a decode when one row after a
    cached prefix), after `decode` = (table, length) of another sequence's decode row when given."""
    seqs = ([decode] if decode else []) + [(table, end)]
    qlens = ([1] if decode else []) + [end - start]
    maxb = max(len(t) for t, _ in seqs)
    slots = ([decode[0][(decode[1] - 1) // bs] * bs + (decode[1] - 1) % bs] if decode else [])
    slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
    nd = (1 if decode else 0) + (1 if end - start == 1 and start > 0 else 0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0))).int(),
        seq_lens=torch.tensor([L for _, L in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (maxb - len(t)) for t, _ in seqs], dtype=torch.int32),
        query_lens_cpu=tuple(qlens), seq_lens_cpu=tuple(L for _, L in seqs), num_decodes=nd,
        max_seq_len=max(L for _, L in seqs))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_prompt_attends_the_same_however_it_is_chunked(backend, kv_dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """A 300-token prompt through the backend (write_kv, then forward, as a layer does): one cold chunk with
    nothing cached, chunks of 16 or 100 over the cached earlier part (next to another sequence's decode row),
    and each row as a decode row: bit-identical attention outputs (what the prefix cache and chunked prefill
    rely on)."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, nb, n = 9, 3, 64, 16, 64, 300
    table = torch.randperm(nb, generator=g)[: -(-n // bs)].tolist()
    other = (torch.randperm(nb, generator=g)[:8].tolist(), 120)  # its blocks hold whatever: only read
    q, k, v = torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    other_q = torch.randn(1, hq, d, generator=g)

    def run(step: int, with_other: bool) -> torch.Tensor:
        kc = torch.zeros(nb, bs, hkv, kv_quant.row_width(d, kv_dtype), dtype=kv_dtype)
        vc = torch.zeros_like(kc)
        outs = []
        for start in range(0, n, step):
            end = min(n, start + step)
            meta = _step(table, bs, start, end, other if with_other else None)
            lead = 1 if with_other else 0
            kk = torch.cat([torch.zeros(lead, hkv, d), k[start:end]])  # the other row's K/V: zeros, written
            vv = torch.cat([torch.zeros(lead, hkv, d), v[start:end]])  # into its own (unread) slot
            backend.write_kv(kk, vv, kc, vc, meta)
            qq = torch.cat([other_q, q[start:end]]) if with_other else q[start:end]
            outs.append(backend.forward(qq, kk, vv, kc, vc, meta, d ** -0.5)[lead:])
        return torch.cat(outs)

    whole = run(n, False)
    ref_kc = kv_quant.as_cached(k, kv_dtype)
    ref = TorchAttentionBackend._causal(q, ref_kc, kv_quant.as_cached(v, kv_dtype), d ** -0.5)
    torch.testing.assert_close(whole, ref, atol=2e-6, rtol=1e-5)
    for step, with_other in ((16, False), (100, True), (1, False)):
        assert torch.equal(run(step, with_other), whole), (step, with_other)


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
    # fp16's edges (the kernel converts 8 at a time): a tie at 1 + 2^-11, past the largest fp16 (inf), the
    # smallest subnormal's half (a tie to 0), subnormals, -0
    k[3, 1] = torch.tensor([1.0 + 2.0 ** -11, 65520.0, -70000.0, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -20, -0.0, 1e-8])
    v[4, 0, 5] = float("nan")  # a NaN's eight convert one by one: torch's NaN is one pattern, F16C's keeps a payload
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        w = kv_quant.row_width(d, dtype)
        caches = [torch.zeros(nb, bs, hkv, w, dtype=dtype) for _ in range(4)]
        backend.write_kv(k, v, caches[0], caches[1], meta)
        TorchAttentionBackend().write_kv(k, v, caches[2], caches[3], meta)
        for mine, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
            if dtype == torch.bfloat16:  # c10::BFloat16's NaN is 0x7FC0, torch's vectorized cast keeps sign and payload
                torch.testing.assert_close(mine, ref, rtol=0, atol=0, equal_nan=True)
            else:  # byte for byte: NaN, -0 and the subnormals included
                assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8)), dtype
        assert caches[0].float().abs().sum() > 0
    bad = AttentionMetadata(torch.tensor([3, 9, 10, 17, nb * bs]), meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0, meta.max_seq_len)
    with pytest.raises(RuntimeError, match="slot out of range"):
        backend.write_kv(k, v, torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d), bad)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (12, 2, 32), (4, 4, 16), (32, 8, 128), (14, 2, 64)])
def test_the_avx512_body_gives_the_avx2_bodys_bits(backend, hq: int, hkv: int, d: int,  # type: ignore[no-untyped-def]
                                                   kv_dtype: torch.dtype) -> None:
    """The AVX-512 body (two FMA chains in one register, eight scores reduced at once by hsum8's tree, V rows
    widened once for several query heads) is the AVX2 body's arithmetic: bit-identical outputs, for decode rows
    and a prefill chunk's grouped rows, query heads a pass of 1 to 8 (GB < G), every cache dtype, 1 and 2
    threads. A CPU without AVX-512 runs the AVX2 body only and has nothing to compare."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(hq * 1000 + d)
    n, bs = 30, 16
    nb = n * 13 + 1
    kc, vc = _cache(nb, bs, hkv, d, kv_dtype, g), _cache(nb, bs, hkv, d, kv_dtype, g)
    tables = torch.randperm(nb - 1, generator=g).add(1).reshape(n, -1).tolist()
    lens = [int(x) for x in torch.randint(1, 200, (n,), generator=g)]
    tables[4:7] = [tables[6]] * 3  # rows 4..6: one prefill chunk's rows (grouped, shared K/V loads)
    lens[4:7] = [150, 151, 157]
    # rows 9..29: a longer chunk (grouped rows for every head count, G = 1 included), its rows ending at every
    # position of a block of 16
    tables[9:30] = [tables[29]] * 21
    lens[9:30] = list(range(163, 184))
    q = torch.randn(n, hq, d, generator=g)
    out = {}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for isa in ("avx2", "avx512"):
                _use_isa(backend, isa)
                out[isa, t] = _attend(backend, q, kc, vc, _meta(tables, lens), d ** -0.5)
    finally:
        torch.set_num_threads(threads)
        backend._mod.set_kv_isa("auto")
    for t in (1, 2):
        assert torch.equal(out["avx2", t], out["avx512", t]), (t, (out["avx2", t] - out["avx512", t]).abs().max())
