"""csrc/lora.cu on a real GPU, through workers/lora/batch.py's CUDA path: a mixed batch (base rows + 3 adapters of
ranks 8, 16 and 64 over q/k/v/o/gate/up/down) against the CPU fp32 Python loop in fp32, bf16 and fp16; and every
row's bits the same alone as in the mixed batch (batch invariance, ==), with the launch grid changing under it.

Skipped unless torch sees CUDA and CuPy imports. Tolerances: the reference is exact fp32 from the same (already
rounded) x and y, so the gap is the summation order (fp32) plus the kernel's two roundings to y's dtype.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.test_lora_cuda_emulate import ATTN, MLP, proj_sizes, random_adapter
from workers.lora.adapter import LoraAdapter
from workers.lora.batch import LoraBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs CUDA and cupy"),
]

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPE_IDS = ["fp32", "fp16", "bf16"]
DIMS = (576, 576, 192, 1536)  # SmolLM2-135M: hidden, q, kv, intermediate
LAYERS = 2
SPECS = (("attn", 8, ATTN, 2.0), ("mlp", 16, MLP, 0.5), ("all", 64, ATTN + MLP, 0.25))
T = 48  # flat rows of the mixed batch


def adapters(device: str) -> dict[str, LoraAdapter]:
    """The same weights on any device (one seed each)."""
    return {n: random_adapter(n, r, mods, DIMS, LAYERS, seed, scale, device)
            for seed, (n, r, mods, scale) in enumerate(SPECS)}


def mixed_rows() -> dict[str, list[int]]:
    """Every third row the base; the rest spread over the adapters, interleaved."""
    rows: dict[str, list[int]] = {n: [] for n, *_ in SPECS}
    names = [n for n, *_ in SPECS]
    for j, t in enumerate(t for t in range(T) if t % 3):
        rows[names[j % len(names)]].append(t)
    return rows


def inputs(proj: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_in, n_out = proj_sizes(DIMS)[proj]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, n_in, generator=g).to(dtype).cuda(), torch.randn(T, n_out, generator=g).to(dtype).cuda())


@pytest.fixture(scope="module")
def gpu_adapters() -> dict[str, LoraAdapter]:
    return adapters("cuda")


@pytest.fixture(scope="module")
def cpu_adapters() -> dict[str, LoraAdapter]:
    return adapters("cpu")


@pytest.mark.parametrize("dtype", list(TOL), ids=DTYPE_IDS)
def test_mixed_batch_matches_the_cpu_fp32_loop(gpu_adapters: dict[str, LoraAdapter],
                                               cpu_adapters: dict[str, LoraAdapter], dtype: torch.dtype) -> None:
    rows = mixed_rows()
    base = [t for t in range(T) if t % 3 == 0]
    gpu = LoraBatch.build(rows, gpu_adapters, None, torch.device("cuda"))
    cpu = LoraBatch.build(rows, cpu_adapters, None, torch.device("cpu"))
    assert gpu is not None and cpu is not None
    for layer in range(LAYERS):
        for i, proj in enumerate(proj_sizes(DIMS)):
            x, y = inputs(proj, dtype, 10 * layer + i)
            y0 = y.clone()
            gpu.add(layer, proj, x, y)
            assert gpu._cuda is not None, "the CUDA kernels did not run"
            want = y0.float().cpu()
            cpu.add(layer, proj, x.float().cpu(), want)
            got = y.float().cpu()
            assert torch.isfinite(got).all() and torch.equal(got[base], y0.float().cpu()[base])
            tol = TOL[dtype]
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{layer} {proj}: {m}")


@pytest.mark.parametrize("dtype", list(TOL), ids=DTYPE_IDS)
def test_each_rows_bits_are_the_same_alone(gpu_adapters: dict[str, LoraAdapter], dtype: torch.dtype) -> None:
    rows = mixed_rows()
    mixed = LoraBatch.build(rows, gpu_adapters, None, torch.device("cuda"))
    assert mixed is not None
    picks = [(n, rs[j]) for n, rs in rows.items() for j in (0, len(rs) // 2, -1)]  # 9 rows, every adapter
    for i, proj in enumerate(proj_sizes(DIMS)):
        x, y = inputs(proj, dtype, 100 + i)
        ym = y.clone()
        mixed.add(1, proj, x, ym)
        for name, r in picks:
            alone = y[r:r + 1].clone()
            solo = LoraBatch.build({name: [0]}, gpu_adapters, None, torch.device("cuda"))
            assert solo is not None
            solo.add(1, proj, x[r:r + 1].contiguous(), alone)
            assert torch.equal(alone[0], ym[r]), f"{proj}: row {r} ({name}) differs alone"
        # the same rows again, reversed and without the base rows: other positions, other grid
        order = {n: rs[::-1] for n, rs in reversed(list(rows.items()))}
        flat = [r for rs in order.values() for r in rs]
        again = LoraBatch.build({n: [flat.index(r) for r in rs] for n, rs in order.items()}, gpu_adapters, None,
                                torch.device("cuda"))
        assert again is not None
        yr = y[flat].clone()
        again.add(1, proj, x[flat].contiguous(), yr)
        assert torch.equal(yr, ym[flat]), f"{proj}: rows differ when reordered"
