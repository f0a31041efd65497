"""The CUDA row kernel (kernels_cupy/csrc/rows.cu: RMSNorm with the residual add) on a real GPU: against the
torch reference, and a row's bits the same alone or among any number of rows. The tiled GEMMs' invariance on
cuBLAS is checked here too. Skipped unless torch sees CUDA and CuPy imports."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from workers.models.fused import rms_norm_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs CUDA and cupy"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
# Output rounding plus the sum order: fp32 exact to ~1e-6; 16-bit outputs are rounded twice, as the reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _rows() -> object:
    from kernels_cupy.rows_cuda import CudaRowOps

    return CudaRowOps()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hidden", [64, 576, 2048, 2050])
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, hidden: int, with_delta: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(37, hidden, device="cuda", generator=g).to(dtype)
    delta = torch.randn(37, hidden, device="cuda", generator=g).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    x_ref = x.clone()
    want = rms_norm_ref(x_ref, delta, w, 1e-5)
    got = _rows().rms_norm(x, delta, w, 1e-5)  # type: ignore[attr-defined]
    assert torch.equal(x, x_ref)  # the residual add, rounded as torch's add_
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_rows_do_not_depend_on_the_row_count(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    probe = torch.randn(1, 576, device="cuda", generator=g).to(dtype)
    w = torch.randn(576, device="cuda", generator=g).to(dtype)
    ops = _rows()
    alone = ops.rms_norm(probe.clone(), None, w, 1e-5)  # type: ignore[attr-defined]
    for n in (2, 13, 64, 513):
        x = torch.randn(n, 576, device="cuda", generator=g).to(dtype)
        x[n // 2] = probe[0]
        assert torch.equal(ops.rms_norm(x, None, w, 1e-5)[n // 2], alone[0]), n  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_gemm_rows_do_not_depend_on_the_row_count_or_place(dtype: torch.dtype) -> None:
    from workers.models.cuda_linear import TiledLinear

    torch.manual_seed(3)
    layer = TiledLinear(nn.Linear(576, 1536, bias=False).to("cuda", dtype))
    probe = torch.randn(1, 576, device="cuda").to(dtype)
    alone = layer(probe)
    for n, at in ((2, 1), (13, 5), (64, 63), (128, 100), (300, 250)):
        x = torch.randn(n, 576, device="cuda").to(dtype)
        x[at] = probe[0]
        assert torch.equal(layer(x)[at], alone[0]), (n, at)
