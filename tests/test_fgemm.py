"""The fixed-order fp32 linear (``flinear``, kernels_cupy/cpu/fgemm.h), the linear layer of ``--quantization none``.

Its point is that a row's result never depends on what else is in the call: every output element is summed in
one documented order whatever M, the tiling, the thread count or split, and the instruction-set path. So:
- accuracy against fp64 F.linear: per element within 1e-5 of sum_k |x_k w_k| + |b| (a fp32 dot of K terms in
  8 lanes of K/8 steps errs by at most ~(K/8 + 3) 2^-24 of that sum: 1e-5 covers K = 1536);
- invariance with torch.equal (bit for bit): rows alone or in any M, 1 or 2 threads, any slice of columns;
- the scalar reference and the AVX2 path bit-identical (each in its own process: the path is chosen once).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernels_cupy.cpu.qgemm import load_qgemm
from tests.cpu_support import built, results_per_isa

REL_TOLERANCE = 1e-5  # of sum_k |x_k w_k| + |b|, see the module docstring


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    mod = built(load_qgemm(), "the quantized GEMM kernel")
    if not hasattr(mod, "flinear"):
        pytest.fail("the CPU kernel module has no flinear")
    return mod


def _data(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g))


@pytest.mark.parametrize("k", [8, 13, 64, 576, 1536])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp64_linear(kernel, k: int, with_bias: bool) -> None:  # type: ignore[no-untyped-def]
    for n in (1, 7, 40, 960):
        for m in (1, 3, 5, 37, 300):
            x, w, b = _data(m, n, k, seed=k * 7 + n * 3 + m)
            bias = b if with_bias else None
            got = kernel.flinear(x, w, bias)
            assert got.shape == (m, n) and got.dtype == torch.float32
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            scale = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
            err = (got.double() - ref).abs()
            assert bool((err <= REL_TOLERANCE * scale).all()), (m, n, k, (err / scale).max().item())


def test_each_row_is_the_same_alone_and_in_any_batch(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w, b = _data(300, 200, 581, seed=1)  # K = 72 * 8 + 5: the padded tail step too
    full = kernel.flinear(x, w, b)
    for i in range(300):
        assert torch.equal(kernel.flinear(x[i:i + 1], w, b), full[i:i + 1]), i
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 299):  # every row-block shape and remainder, at several offsets
        for start in (0, 1, 300 - m):
            assert torch.equal(kernel.flinear(x[start:start + m], w, b), full[start:start + m]), (m, start)


@pytest.mark.parametrize("k", [13, 576])
def test_thread_count_changes_nothing(kernel, k: int) -> None:  # type: ignore[no-untyped-def]
    x, w, b = _data(300, 960, k, seed=k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.flinear(x, w, b)
        torch.set_num_threads(2)
        two = kernel.flinear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(kernel.flinear(x, w, b), one)


def test_any_slice_of_columns_is_the_same_as_in_the_full_call(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w, b = _data(37, 100, 77, seed=2)
    full = kernel.flinear(x, w, b)
    for n in (1, 2, 3, 5, 7, 8, 23, 24, 25, 49, 99):
        assert torch.equal(kernel.flinear(x, w[:n], b[:n]), full[:, :n]), n
    for n0, n1 in ((1, 4), (5, 30), (17, 100), (50, 51)):  # slices of a contiguous w are contiguous
        assert torch.equal(kernel.flinear(x, w[n0:n1], b[n0:n1]), full[:, n0:n1]), (n0, n1)
        assert torch.equal(kernel.flinear(x[3:9], w[n0:n1], None), kernel.flinear(x, w, None)[3:9, n0:n1])


def test_degenerate_shapes(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w, b = _data(3, 5, 4, seed=3)
    assert kernel.flinear(x[:0], w, b).shape == (0, 5)
    assert kernel.flinear(x, w[:0], b[:0]).shape == (3, 0)
    # K = 0: an empty sum, +0, then the bias
    assert torch.equal(kernel.flinear(torch.empty(3, 0), torch.empty(5, 0), b), b.expand(3, 5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [8, 13, 576, 1537])
def test_16bit_weights_give_the_bits_of_their_fp32_widening(kernel, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                                             k: int) -> None:
    x, w, b = _data(6, 29, k, seed=5)
    w16 = w.to(dtype)
    # fp16 subnormals, the largest half, -0: every 16-bit value widens exactly
    w16[0, :4] = torch.tensor([6e-8, -3e-6, 65504.0, -0.0]).to(dtype)[:min(4, k)]
    got = kernel.flinear(x, w16, b)
    assert torch.equal(got, kernel.flinear(x, w16.float(), b))
    torch.testing.assert_close(got.double(), x.double() @ w16.double().t() + b.double(), atol=1e-3, rtol=1e-5)


def test_rejects_bad_inputs(kernel) -> None:  # type: ignore[no-untyped-def]
    x, w, b = _data(4, 6, 16, seed=4)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.flinear(x.t(), w, b)  # not contiguous (and the wrong K)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.flinear(x.double(), w, b)
    with pytest.raises(RuntimeError, match="w must be"):
        kernel.flinear(x, w[:, :8], b)
    with pytest.raises(RuntimeError, match="w must be"):
        kernel.flinear(x, torch.randn(6, 15), b)
    with pytest.raises(RuntimeError, match="w must be"):
        kernel.flinear(x, w.to(torch.int8), b)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.flinear(x, w, b[:5])
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.flinear(x, w, b.double())


_ISA_CHECK = """
import sys
import torch
from kernels_cupy.cpu.qgemm import load_qgemm
mod = load_qgemm()
g = torch.Generator().manual_seed(0)
outs = []
for m, n, k in ((1, 40, 13), (5, 19, 96), (9, 30, 1), (37, 41, 1536), (300, 25, 77), (4, 24, 576)):
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    outs += [mod.flinear(x, w, b).flatten(), mod.flinear(x, w, None).flatten()]
# 16-bit weights (LoRA adapters saved at 16 bits), fp16 subnormals and the largest halves among them
for dt in (torch.float16, torch.bfloat16):
    for m, n, k in ((1, 40, 13), (7, 19, 96), (5, 30, 577)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(dt)
        w[0, :5] = torch.tensor([6e-8, -3e-6, 6.1e-5, 65504.0, -0.0]).to(dt)
        outs.append(mod.flinear(x, w, None).flatten())
# products that round to -0 in a lane, then the padded tail: the sign of zero must come out the same
for k in (8, 13):
    x, w = torch.full((2, k), -1e-30), torch.full((3, k), 1e-30)
    outs.append(mod.flinear(x, w, None).flatten())
torch.save(torch.cat(outs), sys.argv[1])
print(mod.fgemm_isa())
"""


def test_scalar_and_simd_paths_are_bit_identical(kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = results_per_isa(_ISA_CHECK, "KVGATE_FGEMM_ISA", ("scalar", "best"), tmp_path)
    ref = results["scalar"]
    for isa, got in results.items():
        assert torch.equal(got, ref), isa
        assert torch.equal(torch.signbit(got), torch.signbit(ref)), isa  # torch.equal takes -0 == +0
