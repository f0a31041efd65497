"""The A16 block-quantized linear (``qlinear(..., act_bits=16)``, ``kernels_cupy/cpu/qgemm_a16.h``): int16
activations per block of 32 against the exact weight blocks.

- against its own arithmetic in fp64 (activations fake-quantized to int16 as the kernel does): 1e-5 of the
  output scale, the fp32 accumulation being the only difference;
- bit-identical (torch.equal) whatever shares a row's call: other rows (M), the row tiling, the thread count
  and the thread split of N, and whatever the instruction-set path: the numerics are one fixed order;
- far more accurate than the A8 path against fp32 of the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels_cupy.cpu.qgemm import load_qgemm
from tests.cpu_support import built, results_per_isa
from workers.models.quant import BlockWeight, dequantize, quantize

QK = 32


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    return built(load_qgemm(), "the quantized GEMM kernel")


def fake_quantize_int16(x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, K) fp64
    """The kernel's activations: per block of 32, scale amax / 2047 (fp32, 12-bit codes), codes rounded half to even."""
    m, k = x.shape
    b = x.float().reshape(m, k // QK, QK)
    sa = b.abs().amax(-1, keepdim=True) / 2047.0
    inv = torch.where(sa > 0, 1.0 / sa, torch.zeros_like(sa))
    codes = torch.round(b * inv).clamp(-2047, 2047)
    return (codes.double() * sa.double()).reshape(m, k)


def _exact(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:  # (M, N) fp64
    out = fake_quantize_int16(x) @ dequantize(w).double().T
    return out + (0 if bias is None else bias.double())


def _a16(kernel, x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return kernel.qlinear(x, w.codes, w.d, w.m, bias, w.bits, None, 16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 40, 32), (3, 17, 96), (4, 64, 576), (9, 33, 32 * 131), (37, 8, 160),
                                   (300, 13, 96), (5, 11, 32 * 9), (6, 10, 32 * 10), (4, 7, 32 * 13)])
def test_a16_matches_its_exact_arithmetic(kernel, bits: int, m: int, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(m * 1000 + n + k + bits)
    w = quantize(torch.randn(n, k, generator=g) * 0.1, bits)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero block: scale 0 must not divide by zero
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        ref = _exact(x, w, b)
        got = _a16(kernel, x, w, b)
        assert (got.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_a16_row_is_independent_of_its_call(kernel, bits: int) -> None:  # type: ignore[no-untyped-def]
    """A row's output does not depend on the other rows, the row tiling, the thread count or the split of N."""
    g = torch.Generator().manual_seed(bits)
    n, k = 21, 32 * 19  # N not a multiple of 8, an odd block count and a partial last group
    w = quantize(torch.randn(n, k, generator=g) * 0.1, bits)
    x = torch.randn(300, k, generator=g) * torch.rand(300, 1, generator=g) * 4
    bias = torch.randn(n, generator=g)
    whole = _a16(kernel, x, w, bias)
    for r in (0, 5, 17, 299):
        assert torch.equal(_a16(kernel, x[r:r + 1], w, bias), whole[r:r + 1]), r
    assert torch.equal(_a16(kernel, x[5:18], w, bias), whole[5:18])  # M = 13: other micro-tiles
    assert torch.equal(_a16(kernel, x[:37], w, bias), whole[:37])

    def first(cols: int) -> BlockWeight:
        return BlockWeight(bits, w.codes[:cols].contiguous(), w.d[:cols], None if w.m is None else w.m[:cols])

    for cols in (13, 5, 1):  # the threads split N elsewhere
        assert torch.equal(_a16(kernel, x, first(cols), bias[:cols]), whole[:, :cols]), cols
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_a16(kernel, x, w, bias), whole)
    finally:
        torch.set_num_threads(threads)


def test_a16_error_is_far_below_a8(kernel) -> None:  # type: ignore[no-untyped-def]
    """Against fp32 of the same weights, on activations shaped like a model's (a few outlier channels): 12-bit
    codes round 16x finer than int8's (2047 vs 127 steps a block), so the largest error is at least 8x smaller."""
    g = torch.Generator().manual_seed(7)
    k, n = 576, 256
    x = torch.randn(64, k, generator=g)
    x[:, torch.randint(0, k, (6,), generator=g)] *= 20  # outlier channels: what makes int8 blocks coarse
    for bits in (4, 8):
        w = quantize(torch.randn(n, k, generator=g) * 0.05, bits)
        ref = x.double() @ dequantize(w).double().T
        err16 = (_a16(kernel, x, w).double() - ref).abs().max().item()
        err8 = (kernel.qlinear(x, w.codes, w.d, w.m, None, bits).double() - ref).abs().max().item()
        assert err16 * 8 <= err8, (bits, err16, err8)


def test_act_bits_is_checked(kernel) -> None:  # type: ignore[no-untyped-def]
    w = quantize(torch.randn(8, 64), 8)
    with pytest.raises(RuntimeError, match="act_bits"):
        kernel.qlinear(torch.randn(2, 64), w.codes, w.d, None, None, 8, None, 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_no_rows_give_an_empty_result(kernel, bits: int, act_bits: int) -> None:  # type: ignore[no-untyped-def]
    """A step whose requests are all mid-prompt samples no row: the head runs on (0, K) (this crashed the A16
    path's row tiling once)."""
    w = quantize(torch.randn(40, 160), bits)
    out = kernel.qlinear(torch.empty(0, 160), w.codes, w.d, w.m, None, bits, None, act_bits)
    assert out.shape == (0, 40)


_ISA_CHECK = """
import sys, torch
from kernels_cupy.cpu.qgemm import load_qgemm
from workers.models.quant import quantize
mod = load_qgemm()
g = torch.Generator().manual_seed(0)
outs = []
# (K's blocks: 3; 19 and 131 = groups of 8 + a 3-block span group; 9, 10 = a group + 1 or 2; 13 = a padded group;
# on AMX, from 16 rows: 300, 17, 29 and 40 rows = whole tiles + a part, 9, 33 and 40 columns = a part of one or two
# halves; K of 3 blocks (fewer than the 8 lanes: the lanes past K stay zero) and of 9 and 19 (the C ring wraps))
for m, n, k in ((1, 19, 96), (7, 21, 32 * 19), (300, 9, 32 * 131), (5, 11, 32 * 9), (6, 10, 32 * 10), (4, 7, 32 * 13),
                (17, 40, 32 * 19), (16, 33, 96), (32, 40, 32 * 19), (29, 33, 32 * 9), (40, 70, 96)):
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3
    x[0, :32] = 0.0
    x[-1, 32:64] *= 1e-39  # a block of subnormals: its scale underflows, 1 / scale overflows
    bias = torch.randn(n, generator=g)
    for bits in (4, 8):
        w = quantize(torch.randn(n, k, generator=g) * 0.1, bits)
        outs += [mod.qlinear(x, w.codes, w.d, w.m, b, bits, None, 16).flatten() for b in (None, bias)]
torch.save(torch.cat(outs), sys.argv[1])
print(mod.isa())
"""


def test_every_isa_path_is_bit_identical(kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Scalar, AVX2 and (where the CPU has them) VNNI, its lane kernel on 512- and on 256-bit vectors, and AMX give
    the same bits; one process each, as the path is chosen once per process."""
    results = results_per_isa(_ISA_CHECK, "KVGATE_QGEMM_ISA", ("scalar", "avx2", "vnni", "vnni256", "vnni512", "best"),
                              tmp_path)
    for isa, got in results.items():
        assert torch.equal(got, results["scalar"]), isa
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:  # both widths ran (their names differ), not one twice
        assert {"avx512-vnni", "avx512-vnni-ymm"} <= set(results), results.keys()


_PACKED_CHECK = """
import sys, torch
from kernels_cupy.cpu.qgemm import load_qgemm
from workers.models.quant import quantize
mod = load_qgemm()
g = torch.Generator().manual_seed(1)
outs = []
# K of 1 to 26 blocks: no full group, full groups only (8, 16, 24), and every tail of 1 to 7 blocks (the packed
# tail's one-pair and reduced paths, odd tails on the last column: the zero-padded copy); 4- and 8-bit codes; M 1 to
# 11 (the packed kernel's row tiles of 3, then 2 or 1), 12 to 23 (Q4: the lane kernel widening packed groups; Q8:
# still row tiles) and 24 (both: the lane kernel); 37 columns (odd: a last single column).
for bits, nb in [(b, n) for b in (4, 8) for n in range(1, 27)]:
    k = 32 * nb
    w = quantize(torch.randn(37, k, generator=g) * 0.1, bits)
    packed = mod.pack_lanes(w.codes, k)
    bias = torch.randn(37, generator=g)
    for m in (1, 2, 3, 4, 5, 7, 11, 12, 16, 23, 24):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3
        x[0, :32] = 0.0
        plain = mod.qlinear(x, w.codes, w.d, w.m, bias, bits, None, 16)
        if mod.packed_codes_ok():  # the AVX2 and VNNI paths, not scalar nor AMX
            got = mod.qlinear(x, packed, w.d, w.m, bias, bits, None, 16, True)
            if not torch.equal(got, plain):
                sys.exit(f"packed != plain: bits {bits}, K {k}, M {m}")
            outs.append(got.flatten())
        else:
            try:
                mod.qlinear(x, packed, w.d, w.m, bias, bits, None, 16, True)
                sys.exit("packed weights were accepted off the AVX2 path")
            except RuntimeError as e:
                assert "wlanes" in str(e), e
            outs.append(plain.flatten())
torch.save(torch.cat(outs), sys.argv[1])
print(mod.isa())
"""


def test_packed_weights_give_the_same_bits(kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Codes packed in lane order (``pack_lanes``, a model's layout on the AVX2 and VNNI paths) give the bits of
    the GGUF's own order on those paths, and so the scalar reference's; other paths (scalar, AMX) refuse them."""
    results = results_per_isa(_PACKED_CHECK, "KVGATE_QGEMM_ISA", ("scalar", "avx2", "vnni256", "vnni512", "best"),
                              tmp_path)
    if "avx2" not in results:
        pytest.skip("this CPU has no AVX2 path")
    for isa, got in results.items():
        assert torch.equal(got, results["scalar"]), isa


def test_pack_lanes_moves_bytes_within_full_groups(kernel) -> None:  # type: ignore[no-untyped-def]
    """4-bit: byte 32 q + 4 j + t of a full group is byte 4 q + t of its block j; the tail blocks keep their bytes."""
    n, k = 3, 32 * 19  # two full groups and a 3-block tail
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = kernel.pack_lanes(codes, k)
    for g in range(2):
        for q in range(4):
            for j in range(8):
                for t in range(4):
                    assert torch.equal(packed[:, g * 128 + 32 * q + 4 * j + t], codes[:, g * 128 + 16 * j + 4 * q + t])
    assert torch.equal(packed[:, 256:], codes[:, 256:])
    with pytest.raises(RuntimeError, match="uint8"):
        kernel.pack_lanes(codes.to(torch.int8), k)
    # 8-bit: byte 16 s + 2 j + h of a full group is byte 4 (s // 2) + 2 h + s % 2 of its block j
    codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    packed8 = kernel.pack_lanes(codes8, k)
    for g in range(2):
        for s in range(16):
            for j in range(8):
                for h in range(2):
                    got, want = g * 256 + 16 * s + 2 * j + h, g * 256 + 32 * j + 4 * (s // 2) + 2 * h + s % 2
                    assert torch.equal(packed8[:, got], codes8[:, want])
    assert torch.equal(packed8[:, 512:], codes8[:, 512:])
