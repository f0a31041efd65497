"""``lora_add`` (kernels_cupy/cpu/lora_add.h) on its own: its output bit for bit the per-group, per-slice loop it
replaced (flinear's shrink and expand, the scale as one fp32 multiply, one fp32 add), whatever the group sizes
(one group of 300 rows cut into chunks across the threads, eight groups of 2 rows, mixed), ranks, slices and
weight widths, at 1 and 2 threads; and the same bits at 1 and 2 threads. The expand's AVX2 lanes path (rank
<= 64) and fgemm's (rank 72 here) are both reached, and the scalar path (KVGATE_FGEMM_ISA=scalar, fgemm
throughout) gives the AVX2 path's bits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels_cupy.cpu.qgemm import load_qgemm
from tests.cpu_support import built, results_per_isa


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    mod = built(load_qgemm(), "the quantized GEMM kernel")
    if not hasattr(mod, "lora_add"):
        pytest.fail("the CPU kernel module has no lora_add")
    return mod


def _case(sizes: list[int], ranks: list[int], slices: list[list[tuple[int, int]]], dtype: torch.dtype, t: int,
          k: int, n_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """x (t, k), y (t, n_out), and lora_add's arguments: group g has sizes[g] rows (disjoint, shuffled, some
    rows in no group), rank ranks[g] per target and slices[g] = [(lo, hi), ...] of y, one target each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n_out, generator=g)
    perm = torch.randperm(t, generator=g)
    rows, a, scale, s_group, s_cols, b = [], [], [], [], [], []
    at = 0
    for gi, (n, r, sl) in enumerate(zip(sizes, ranks, slices)):
        rows.append(perm[at:at + n].clone())
        at += n
        a.append((torch.randn(r * len(sl), k, generator=g) / k ** 0.5).to(dtype))
        scale.append(0.5 + 1.5 * gi / max(1, len(sizes)))
        for j, (lo, hi) in enumerate(sl):
            s_group.append(gi)
            s_cols += [lo, hi, j * r, (j + 1) * r]
            b.append((torch.randn(hi - lo, r, generator=g) / r ** 0.5).to(dtype))
    assert at <= t
    return x, y, (rows, a, scale, s_group, s_cols, b)


def _reference(kernel: Any, x: torch.Tensor, y: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """workers/lora/batch.py's loop on flinear: per group the shrink, per slice the expand, scale and add."""
    rows, a, scale, s_group, s_cols, b = args
    out = y.clone()
    for s, gi in enumerate(s_group):
        lo, hi, rlo, rhi = s_cols[4 * s:4 * s + 4]
        h = kernel.flinear(x.index_select(0, rows[gi]).contiguous(), a[gi], None)
        d = kernel.flinear(h[:, rlo:rhi].contiguous(), b[s], None)
        d.mul_(scale[gi])
        out[rows[gi], lo:hi] += d
    return out


def _run(kernel: Any, x: torch.Tensor, y: torch.Tensor, args: tuple[Any, ...], threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = y.clone()
        kernel.lora_add(x, out, *args)
        return out
    finally:
        torch.set_num_threads(before)


QKV = [(0, 96), (96, 128), (128, 160)]  # three targets of one projection (q, k, v)
CASES = {
    "one group of 300 rows": ([300], [16], [QKV]),
    "eight groups of 2 rows": ([2] * 8, [16] * 8, [QKV] * 8),
    "mixed sizes, ranks and slices": ([1, 2, 3, 4, 5, 37, 130], [4, 8, 16, 13, 3, 64, 72],
                                      [QKV, [(0, 160)], [(5, 47), (100, 101)], QKV, [(0, 7), (7, 160)],
                                       [(0, 160)], [(17, 150)]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equals_the_per_group_loop(kernel: Any, case: str, dtype: torch.dtype) -> None:
    sizes, ranks, slices = CASES[case]
    x, y, args = _case(sizes, ranks, slices, dtype, t=max(320, sum(sizes) + 3), k=72, n_out=160, seed=len(case))
    want = _reference(kernel, x, y, args)
    one = _run(kernel, x, y, args, 1)
    two = _run(kernel, x, y, args, 2)
    assert torch.equal(one, want), (case, dtype)
    assert torch.equal(two, want), (case, dtype)
    assert torch.equal(one, two)
    untouched = torch.ones(x.size(0), dtype=torch.bool)
    for r in args[0]:
        untouched[r] = False
    assert torch.equal(one[untouched], y[untouched])


@pytest.mark.parametrize("k,rank", [(576, 16), (64, 5), (40, 32)])
def test_projection_shapes(kernel: Any, k: int, rank: int) -> None:
    """SmolLM2-like widths (gate_up: 3072 columns in two slices) and odd ones, a prefill-sized group among
    decode-sized ones, bf16 weights: the same bits as the loop at 1 and 2 threads."""
    n_out = 3072 if k == 576 else 200
    half = n_out // 2
    sizes = [512, 2, 2, 1] if k == 576 else [64, 9, 2]
    sl = [[(0, half), (half, n_out)]] * len(sizes)
    x, y, args = _case(sizes, [rank] * len(sizes), sl, torch.bfloat16, t=sum(sizes) + 1, k=k, n_out=n_out, seed=k)
    want = _reference(kernel, x, y, args)
    for threads in (1, 2):
        assert torch.equal(_run(kernel, x, y, args, threads), want), threads


@pytest.mark.parametrize("k", [37, 13, 8])
def test_decode_groups_with_any_input_width(kernel: Any, k: int) -> None:
    """Groups of 1-4 rows (a decode step's) shrink through lora_rows.h: an input width that is no multiple of 8
    (the rows padded with +0 to whole steps, as fgemm pads), and a row of -0 inputs (whose sums must stay +0, as
    fgemm's do), give the loop's bits at 1 and 2 threads."""
    sizes = [1, 2, 3, 4, 2]
    sl = [[(0, 30), (30, 50)]] * len(sizes)
    for dtype in (torch.float32, torch.bfloat16):
        x, y, args = _case(sizes, [5, 8, 16, 3, 64], sl, dtype, t=sum(sizes) + 2, k=k, n_out=50, seed=k)
        zero = args[0][1][0]  # a row of -0 inputs, its output row +0: its delta must come out exactly +0
        x[zero], y[zero] = -0.0, 0.0
        want = _reference(kernel, x, y, args)
        assert not want[zero].any() and not torch.signbit(want[zero]).any()
        for threads in (1, 2):
            assert torch.equal(_run(kernel, x, y, args, threads), want), (dtype, threads)


def test_repeated_rows_run_in_group_order(kernel: Any) -> None:
    """A row index in two groups (the engine never does this): every add still lands, in group order."""
    x, y, args = _case([40, 40], [8, 8], [[(0, 64)], [(0, 64)]], torch.float32, t=80, k=32, n_out=64, seed=3)
    rows = args[0]
    rows[1] = rows[0].clone()
    assert torch.equal(_run(kernel, x, y, args, 2), _reference(kernel, x, y, args))


def test_scalar_path_gives_the_same_bits(tmp_path: Any) -> None:
    script = (
        "import sys, torch\n"
        "from kernels_cupy.cpu.qgemm import load_qgemm\n"
        "from tests.test_lora_add_kernel import CASES, _case\n"
        "k = load_qgemm()\n"
        "outs = []\n"
        "for name in sorted(CASES):\n"
        "    sizes, ranks, slices = CASES[name]\n"
        "    for dt in (torch.float32, torch.bfloat16, torch.float16):\n"
        "        x, y, args = _case(sizes, ranks, slices, dt, t=sum(sizes) + 3, k=72, n_out=160, seed=1)\n"
        "        k.lora_add(x, y, *args)\n"
        "        outs.append(y)\n"
        "torch.save(outs, sys.argv[1])\n"
        "print(k.fgemm_isa())\n")
    results = results_per_isa(script, "KVGATE_FGEMM_ISA", ("scalar", "avx2"), tmp_path)
    ref = results.pop("scalar")
    for name, outs in results.items():
        assert all(torch.equal(o, r) for o, r in zip(outs, ref)), name
