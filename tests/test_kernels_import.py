"""The CUDA wrappers import on a machine without CuPy or a GPU, and backend selection falls back clearly."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from kernels_cupy import cupy_backend as CB
from kernels_cupy import kernels as K
from tests.kernel_cases import build_case
from kernels_cupy.interface import AttentionBackend
from kernels_cupy.torch_ref import TorchAttentionBackend

# The emulation and the test cases (tests/) ride along: they import the kernels' launch plans too.
IMPORT_ALL = ("import kernels_cupy, kernels_cupy.cupy_backend, kernels_cupy.kernels, tests.kernel_emulate, "
              "tests.kernel_cases")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=".")


def test_wrappers_import_with_cupy_unimportable() -> None:
    # sys.modules["cupy"] = None makes any `import cupy` raise ImportError, as on a machine without it.
    r = run_python(f"import sys; sys.modules['cupy'] = None; {IMPORT_ALL}; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_importing_never_loads_cupy() -> None:
    r = run_python(f"import sys; {IMPORT_ALL}; print('cupy' in sys.modules)")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_cpu_device_selects_the_reference_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        import kernels_cupy

        backend = kernels_cupy.cuda_backend_or_reference("cpu")
    assert isinstance(backend, TorchAttentionBackend) and not caplog.records


def test_cuda_without_a_gpu_falls_back_with_the_reason(caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        backend = CB.cuda_backend_or_reference("cuda")
    assert isinstance(backend, TorchAttentionBackend)
    assert "torch sees no CUDA device" in caplog.text and "torch reference" in caplog.text


def test_cuda_without_cupy_falls_back_with_install_hint(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with caplog.at_level(logging.WARNING):
        backend = CB.cuda_backend_or_reference(torch.device("cuda", 0))
    assert isinstance(backend, TorchAttentionBackend)
    assert "pip install 'kvgate[cuda]'" in caplog.text


def test_constructing_the_cupy_backend_without_cupy_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(RuntimeError, match="cupy-cuda12x"):
        CB.CupyAttentionBackend()
    with pytest.raises(ValueError):
        CB.CupyAttentionBackend(split="sometimes")


def fake_cupy_backend(monkeypatch: pytest.MonkeyPatch) -> CB.CupyAttentionBackend:
    """A backend whose CuPy is a stub: enough to exercise the host-side decisions on a CPU."""
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    return CB.CupyAttentionBackend()


def test_uncovered_layouts_go_to_the_reference_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    backend = fake_cupy_backend(monkeypatch)
    tiny = torch.zeros(8, 4, 2, 16)  # head_dim 16, as the tiny test models have
    with caplog.at_level(logging.WARNING):
        assert backend._config(tiny, 4, torch.float32) is None
        assert backend._config(tiny, 4, torch.float32) is None
    assert caplog.text.count("head_dim 16") == 1
    bf16_cache = torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16)
    assert backend._config(bf16_cache, 9, torch.bfloat16) == K.KernelConfig("bfloat16", 64, 16, 3)
    assert backend._config(bf16_cache, 9, torch.float32) == K.KernelConfig("bfloat16", 64, 16, 3, "float32")
    assert backend._config(bf16_cache, 9, torch.float64) == K.KernelConfig("bfloat16", 64, 16, 3)  # cast


def test_cpu_tensors_are_rejected_with_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = fake_cupy_backend(monkeypatch)
    c = build_case([(5, 1), (9, 3)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="CUDA caches"):
        backend.write_kv(c.key, c.value, c.k_cache, c.v_cache, c.meta)
    with pytest.raises(ValueError, match="CUDA caches"):
        backend.forward(c.query, c.key, c.value, c.k_cache, c.v_cache, c.meta, c.scale)


def test_protocol_signatures_match_the_interface() -> None:
    for name in ("write_kv", "forward"):
        want = list(inspect.signature(getattr(AttentionBackend, name)).parameters)
        assert list(inspect.signature(getattr(CB.CupyAttentionBackend, name)).parameters) == want


def test_arguments_are_packed_with_the_kernels_c_types() -> None:
    plan = K.plan_forward(32, 8, 128, (6144, 128), 10, (1, 1, 7), (300, 5000, 40), 2, 0.088, 132)
    bufs = {name: torch.zeros(4) for name in ("out", "query", "k_cache", "v_cache", "block_tables", "seq_lens",
                                                "query_start_loc", "tmp_out", "max_logits", "exp_sums")}
    ctype = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "f32": np.float32}
    roles = []
    for launch in plan.launches:
        packed = CB._pack(launch, bufs)
        assert [type(a) for a in packed] == [ctype[k] for k in K.SIGNATURES[launch.function]]
        assert int(packed[0]) == bufs["out" if launch.role != "decode_split" else "tmp_out"].data_ptr()
        roles.append(launch.role)
    assert roles == ["decode_split", "decode_reduce", "prefill"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bandwidth_bench_exits_clearly_without_cuda() -> None:
    r = subprocess.run([sys.executable, "bench/attention.py", "--batches", "1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "no CUDA device" in r.stderr, r.stderr
