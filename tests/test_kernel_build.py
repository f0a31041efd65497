"""The CPU extensions' build (kernels_cupy/cpu/build.py): a killed build's lock cannot hang a later load,
a live builder holding the lock makes a load give up at its deadline, and compile flags key the build dir."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cupy.cpu.build import build_dir, build_key

# pybind11 alone, not <torch/extension.h>: the build path is the same (torch's load, our lock), the compile ~4x
# shorter (~13 s against ~45 s on a loaded Zen 1).
_SRC = """
#include <pybind11/pybind11.h>
int64_t answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
_FLAGS = ["-O0"]
_REPO = Path(__file__).resolve().parents[1]


def _load_in_subprocess(tmp: Path, src: Path, timeout_s: float, env_extra: dict[str, str]) -> str:
    code = ("import sys; from pathlib import Path; from kernels_cupy.cpu.build import load_extension\n"
            "try:\n"
            f"    m = load_extension('kvgate_test_ext', [Path({str(src)!r})], cflags={_FLAGS!r}, ldflags=[])\n"
            "    print('ANSWER', m.answer())\n"
            "except Exception as e:\n"
            "    print('FAILED', type(e).__name__)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp / "ext"), **env_extra}
    out = subprocess.run([sys.executable, "-c", code], cwd=_REPO, env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    return out.stdout


@pytest.fixture
def src(tmp_path: Path) -> Path:
    p = tmp_path / "answer.cpp"
    p.write_text(_SRC)
    return p


def _dir(tmp: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp / "ext"))
    d = build_dir("kvgate_test_ext", build_key([src], [], _FLAGS, []))
    d.mkdir(parents=True)
    return d


@pytest.mark.timeout(1300)
def test_stale_lock_from_a_killed_build_does_not_hang(tmp_path: Path, src: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # What a build SIGKILLed inside torch's cpp_extension leaves: its FileBaton lock file, no owner.
    (_dir(tmp_path, src, monkeypatch) / "lock").write_text("")
    # Before the fix this waited forever. The compile of this one-function file took 10 s on an idle 2-core Zen 3
    # and over 300 s on the same machine at load 13, so the bound only has to tell "finished" from "forever".
    assert "ANSWER 42" in _load_in_subprocess(tmp_path, src, 1200, {})


def test_a_held_build_lock_times_out_instead_of_hanging(tmp_path: Path, src: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    d = _dir(tmp_path, src, monkeypatch)
    fd = os.open(d.parent / f"{d.name}.flock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder (this test) holds the lock
    try:
        out = _load_in_subprocess(tmp_path, src, 60, {"KVGATE_KERNEL_BUILD_TIMEOUT": "1"})
    finally:
        os.close(fd)
    assert "FAILED BuildLockTimeout" in out


def test_flags_and_sources_key_the_build_dir(src: Path) -> None:
    k = build_key([src], [], _FLAGS, [])
    assert build_key([src], [], _FLAGS, []) == k  # stable: same inputs, same dir, no rebuild
    assert build_key([src], [], ["-O3"], []) != k  # other flags build elsewhere instead of overwriting
    src.write_text(_SRC + "\n// changed\n")
    assert build_key([src], [], _FLAGS, []) != k


_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC Processor
flags\t\t: fpu sse sse2 avx avx2 fma{extra}

processor\t: 1
model name\t: AMD EPYC Processor
flags\t\t: fpu sse sse2 avx avx2 fma{extra}
"""


def test_native_builds_are_keyed_by_the_cpu_flags_not_its_name(tmp_path: Path, src: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Zen 1, 3 and 4 all report "AMD EPYC Processor": a -march=native build keyed by that name was reused by an
    # AVX2-only host after an AVX-512 one built it (SIGILL). The feature flags tell them apart.
    import kernels_cupy.cpu.build as build

    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(build, "_CPUINFO", info)
    native = ["-O3", "-march=native"]

    def key(extra: str, flags: list[str]) -> str:
        info.write_text(_CPUINFO.format(extra=extra))
        build.cpu_identity.cache_clear()
        return build_key([src], [], flags, [])

    zen3, zen4 = key("", native), key(" avx512f avx512bw avx512_vnni", native)
    assert zen3 != zen4
    assert key("", native) == zen3  # the same CPU finds its own build again
    assert key("", _FLAGS) == key(" avx512f", _FLAGS)  # portable builds (run-time dispatch) are shared


def test_a_native_build_made_for_another_cpu_is_refused(tmp_path: Path, src: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The run-time check behind the key: a build directory whose stamp names other CPU flags (copied in, or a
    # key that collided) is never loaded; the caller falls back to the reference path.
    import kernels_cupy.cpu.build as build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    native = ["-O0", "-march=native"]
    d = build_dir("kvgate_test_ext", build_key([src], [], native, []))
    d.mkdir(parents=True)
    (d / build.CPU_STAMP).write_text("flags\t\t: fpu sse sse2 avx avx2 avx512f avx512_vnni amx_int8")
    with pytest.raises(RuntimeError, match="built for another CPU"):
        build.load_extension("kvgate_test_ext", [src], cflags=native, ldflags=[])
