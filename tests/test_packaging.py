"""A wheel built from the repo carries the C++ CPU kernel sources, and installed outside the repo it runs the
kernel paths, not the slow fallback (issue 27 item 5: package data once listed only the CUDA sources, so an
installed kvgate silently ran de-quantized fp32 linears and the torch attention reference)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
# The quantized linear, the attention kernel and the decode stack (which calls those two modules' kernels and the
# fused ops'): one process each, run side by side, since each build compiles one file on one core. The stack's
# process builds its glue and the fused ops, then loads the other two from the same build cache, waiting on their
# build locks (Zen 4, alone: the test 60 -> 49 s, where the stack ran after the other two).
_CHECK = """
import sys, kernels_cupy.cpu as cpu
from kernels_cupy.cpu.qgemm import load_qgemm
assert cpu.__file__.startswith(sys.argv[1]), cpu.__file__  # the installed copy, not the checkout
from kernels_cupy.cpu.stack import load_stack
loaders = {"qgemm": load_qgemm, "attention": cpu.load, "stack": load_stack}
print(sys.argv[2], loaders[sys.argv[2]]() is not None)
"""
_KERNELS = ("qgemm", "attention", "stack")
# Not copied for the build: setuptools builds in the source tree (build/, *.egg-info), so it gets a copy.
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".pytest_cache",
                               "node_modules", "kvgate.db*")


@pytest.mark.timeout(1800)  # four kernel builds from the installed sources: minutes on a slow, loaded CPU
def test_the_wheel_carries_and_runs_the_cpu_kernels(tmp_path: Path) -> None:
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    shutil.copytree(_REPO, src, ignore=_SKIP)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, timeout=600, cwd=tmp_path)
    (whl,) = wheels.glob("kvgate-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    cpu_sources = {p.relative_to(_REPO).as_posix() for p in (_REPO / "kernels_cupy" / "cpu").iterdir()
                   if p.suffix in (".cpp", ".h")}
    assert cpu_sources and cpu_sources <= names, sorted(cpu_sources - names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)],
                   check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}

    def check(kernel: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _CHECK, str(site), kernel], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=1500)

    with ThreadPoolExecutor(len(_KERNELS)) as pool:
        for kernel, out in zip(_KERNELS, pool.map(check, _KERNELS)):
            assert out.returncode == 0, out.stderr[-3000:]
            assert f"{kernel} True" in out.stdout, out.stdout + out.stderr[-3000:]
