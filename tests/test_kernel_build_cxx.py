"""Which C++ compiler the CPU extensions are built with (kernels_cupy/cpu/build.py, cxx_compiler): one that
would link libstdc++ statically into an extension is replaced, because the extension's own copy of libstdc++
cannot format a number into an error (the lent H100 image's CXX: a SIGSEGV there, a truncated message here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels_cupy.cpu import build

_REPO = Path(__file__).resolve().parents[1]

# A compiler as that image's: it finds only libstdc++.a (so -print-file-name answers the bare name) and links
# the archive into shared objects.
_STATIC_CXX = """#!/bin/sh
for a in "$@"; do
  if [ "$a" = "-print-file-name=libstdc++.so" ]; then echo libstdc++.so; exit 0; fi
done
for a in "$@"; do
  if [ "$a" = "-shared" ]; then exec {real} "$@" -static-libstdc++; fi
done
exec {real} "$@"
"""

# TORCH_CHECK's header and pybind11, not all of <torch/extension.h>: the same hazard (the message's number is lost
# under the static compiler), a compile ~4x shorter.
_SRC = """
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
void check_negative(int64_t n) { TORCH_CHECK(n < 0, "value ", n, " is not negative"); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("check_negative", &check_negative); }
"""


def _real_cxx() -> str:
    for name in ("c++", "g++"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no C++ compiler on PATH (the CPU kernels need one)")


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def static_cxx(tmp_path: Path) -> Path:
    return _script(tmp_path / "static-cxx", _STATIC_CXX.format(real=_real_cxx()))


@pytest.fixture(autouse=True)
def _fresh_choice() -> Iterator[None]:
    build.cxx_compiler.cache_clear()
    yield
    build.cxx_compiler.cache_clear()


def test_a_compiler_without_a_shared_libstdcxx_is_detected(static_cxx: Path, tmp_path: Path) -> None:
    assert build._shared_libstdcxx(_real_cxx())
    assert not build._shared_libstdcxx(str(static_cxx))
    assert not build._shared_libstdcxx(str(tmp_path / "no-such-compiler"))


def test_cxx_is_kept_when_it_links_the_shared_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", _real_cxx())
    assert build.cxx_compiler() is None


def test_a_static_only_cxx_is_replaced_by_one_on_path(static_cxx: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    good = _script(bin_dir / "c++", f'#!/bin/sh\nexec {_real_cxx()} "$@"\n')
    monkeypatch.setenv("CXX", str(static_cxx))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert build.cxx_compiler() == str(good)
    with build._compiler_env():
        assert os.environ["CXX"] == str(good)
    assert os.environ["CXX"] == str(static_cxx)  # restored after the build


def _run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=_REPO, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=900)
    return f"rc={out.returncode}\n{out.stdout}{out.stderr[-2000:]}"


_CALL = ("try:\n"
         "    m.check_negative(3)\n"
         "except RuntimeError as e:\n"
         "    print('ERROR:', str(e).splitlines()[0])\n")


@pytest.mark.timeout(1300)
def test_an_extension_built_under_a_static_only_cxx_formats_its_errors(static_cxx: Path, tmp_path: Path) -> None:
    src = tmp_path / "check.cpp"
    src.write_text(_SRC)
    env = {"CXX": str(static_cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    # The hazard itself, through torch's own load with that compiler: the message loses its number (or the
    # process dies, as on the H100 image). Without this the check below could not fail.
    bare_code = ("import torch.utils.cpp_extension as ce\n"
                 f"m = ce.load('kvgate_cxx_bare', [{str(src)!r}], build_directory={str(tmp_path)!r}, "
                 "extra_cflags=['-O0'])\n" + _CALL)
    # Through build.load_extension: built with a compiler that links the shared libstdc++, the error is whole.
    ours_code = ("from pathlib import Path\nfrom kernels_cupy.cpu.build import load_extension\n"
                 f"m = load_extension('kvgate_cxx_ours', [Path({str(src)!r})], cflags=['-O0'], ldflags=[])\n"
                 + _CALL)
    with ThreadPoolExecutor(2) as pool:  # two builds in two directories, side by side
        bare, ours = pool.map(lambda code: _run(code, env), (bare_code, ours_code))
    assert "ERROR: value 3 is not negative" not in bare, bare
    assert "ERROR: value 3 is not negative" in ours, ours
