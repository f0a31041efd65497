"""The fused C++ decoder ops (kernels_cupy/cpu/fused_ops.cpp) against their torch references
(workers/models/fused.py), and the model's output with them against the reference ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels_cupy.cpu.fused import load_fused
from workers.models.fused import REFERENCE, FusedOps, rms_norm_ref, rope_ref, silu_mul_ref


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    mod = load_fused()
    if mod is None:
        pytest.fail("the fused CPU ops did not build (gcc and ninja are part of the dev setup)")
    return FusedOps(mod)


@pytest.mark.parametrize("t,n", [(1, 576), (7, 64), (16, 37)])
def test_rms_norm_with_and_without_residual(ops: FusedOps, t: int, n: int) -> None:
    g = torch.Generator().manual_seed(t * n)
    x, d, w = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(ops.rms_norm(x.clone(), None, w, 1e-5), rms_norm_ref(x.clone(), None, w, 1e-5))
    xk, xr = x.clone(), x.clone()
    out_k, out_r = ops.rms_norm(xk, d, w, 1e-5), rms_norm_ref(xr, d, w, 1e-5)
    torch.testing.assert_close(out_k, out_r)
    torch.testing.assert_close(xk, xr, rtol=0, atol=0)  # the residual add is exact: x += delta in place


def test_rope_in_place_matches_reference_and_leaves_v(ops: FusedOps) -> None:
    t, hq, hkv, d, max_len = 5, 9, 3, 64, 100
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    ang = torch.randn(max_len, d // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    pos = torch.tensor([0, 3, 99, 42, 42])
    a, b = qkv.clone(), qkv.clone()
    ops.rope_qk_(a, hq + hkv, d, (cos, sin), pos)
    REFERENCE.rope_qk_(b, hq + hkv, d, (cos, sin), pos)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # no FMA contraction: products round as torch's do
    torch.testing.assert_close(a[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:], rtol=0, atol=0)  # v untouched
    x = qkv[:, :hq * d].view(t, hq, d)
    torch.testing.assert_close(a[:, :hq * d].view(t, hq, d), rope_ref(x, cos[pos][:, None], sin[pos][:, None]),
                               rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError):
        ops.rope_qk_(a, hq + hkv, d, (cos, sin), torch.tensor([0, 1, 2, 3, 100]))  # past the table


def test_silu_mul(ops: FusedOps) -> None:
    gu = torch.randn(3, 2 * 160, generator=torch.Generator().manual_seed(2)) * 4
    torch.testing.assert_close(ops.silu_mul(gu), silu_mul_ref(gu))


@pytest.mark.parametrize("width", [8, 13, 1536])  # 13: the 8-wide body plus a scalar tail
def test_silu_mul_over_the_whole_float_range(ops: FusedOps, width: int) -> None:
    # The vectorised exp clamps its argument: the extremes (where exp(-g) under- or overflows) must still
    # give silu(g) ~ g for large g and ~ 0 for very negative g, as the reference does.
    g = torch.Generator().manual_seed(width)
    gate = torch.randn(4, width, generator=g) * 30
    gate[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30])[:width]
    gate[1] = torch.linspace(-90, 90, width)
    gu = torch.cat([gate, torch.randn(4, width, generator=g)], dim=1)
    out = ops.silu_mul(gu)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_mul_ref(gu), rtol=2e-6, atol=1e-6)


def test_the_loader_gives_an_fp32_cpu_model_the_fused_ops(ops: FusedOps) -> None:
    # End to end, the fused path is checked by tests/test_engine_tiny.py (greedy = transformers) and the
    # golden test on SmolLM2: both run it, since the engine's fp32 CPU models get it here.
    from tests.tiny import hf_model, tiny_engine

    engine: Any = tiny_engine(hf_model())
    assert engine.runner.model.ops.kernel is not None
