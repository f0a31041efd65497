"""Build-and-load for our C++ CPU extensions, safe against killed builds and concurrent workers.

torch's ``cpp_extension.load`` guards a build with a bare lock *file* (``FileBaton``: ``O_CREAT|O_EXCL``, then
a wait that polls until the file is gone, with no timeout). A build killed midway (a worker SIGKILLed by a
chaos drill, an OOM kill) leaves that file behind and every later ``load`` waits on it forever. Its build
directory is also keyed by the extension's name only, so callers whose compile arguments differ overwrite
each other's build and rebuild in turn.

So each extension gets:

- one build directory per *content key* (sources and headers with their paths, flags, torch and Python
  versions, and where ``-march=native`` is used the CPU's model name *and feature flags*): different flags can
  never share, hence never alternate rebuilds; the key also means a new version of a kernel never loads a stale
  binary. Keyed by the model name alone, Zen 1, 3 and 4 ("AMD EPYC Processor" all) shared one native build, and
  an AVX2 host sharing a cache with an AVX-512 one died of SIGILL;
- for a native build, a stamp of the CPU identity it was built for (``CPU_STAMP``), checked before loading: a
  build directory for other CPU flags is refused (the caller falls back) rather than run;
- an ``fcntl.flock`` around the whole load: the kernel releases it when its holder dies, so it cannot go
  stale; it is taken with a deadline (``KVGATE_KERNEL_BUILD_TIMEOUT`` seconds, default 600) so a live but
  stuck builder makes the caller fall back to the reference path instead of hanging;
- under that lock, torch's own lock file (if any) is known to be stale (no one else can be building in the
  directory) and is removed before ``load`` runs;
- a compiler that links libstdc++ into the extension is not used (``cxx_compiler``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_POLL_S = 0.1
log = logging.getLogger(__name__)


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock past the deadline."""


def extensions_root() -> Path:
    """Where builds go: ``TORCH_EXTENSIONS_DIR`` like torch, else ``~/.cache/torch_extensions``; ours in kvgate/."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torch_extensions")
    return Path(base) / "kvgate"


# The flags of the build that uses this CPU's own instruction set (the attention kernel). -mtune=generic:
# -march=native alone also tunes for this CPU, and GCC 12's znver3 tuning (what it makes of a Zen 3 or Zen 4) ran
# the VNNI lane kernel 25-40% slower than the generic tuning the GEMM module is built and measured with, back when
# the decode stack compiled the GEMMs with these flags (bench/build_tuning.py; the stack now calls the modules'
# own kernels: kernel_api.h). Attention measured the same either way (bench/RESULTS.md, twenty-third session).
# -ffp-contract=off in every CPU kernel build: no fused multiply-add the source does not write, so the scalar,
# AVX2 and AVX-512 paths round alike.
NATIVE_CFLAGS = ("-O3", "-march=native", "-mtune=generic", "-ffp-contract=off", "-fopenmp")

_CPUINFO = Path("/proc/cpuinfo")
CPU_STAMP = "cpu_identity"  # in a native build's directory: the cpu_identity() it was built for


@functools.lru_cache(maxsize=1)
def cpu_identity() -> str:
    """The first CPU's model name and feature flags (what ``-march=native`` compiles for), else the platform's
    processor string."""
    try:
        lines = _CPUINFO.read_text().splitlines()
    except OSError:
        return platform.processor()
    name = next((ln for ln in lines if ln.startswith("model name")), "")
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return f"{name}\n{flags}" if name or flags else platform.processor()


def _shared_libstdcxx(cxx: str) -> bool:
    """Whether ``cxx`` links C++ programs against a shared libstdc++ (its search path has ``libstdc++.so``)."""
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(out) and os.path.exists(out)


@functools.lru_cache(maxsize=1)
def cxx_compiler() -> str | None:
    """The compiler our builds use instead of ``$CXX`` (torch's choice, default ``c++``), or None to keep it.

    A compiler whose search path has only ``libstdc++.a`` links the archive into the extension (the lent H100
    image's ``CXX=/opt/gcc/bin/g++``), so the process then holds two copies of libstdc++: torch's shared one and
    ours. Ours crashed (SIGSEGV in its locale code) formatting any number into an error, so every ``TORCH_CHECK``
    with a number in its message killed the worker instead of raising (bench/RESULTS.md, tenth session). Such
    a compiler is replaced by the first ``c++``/``g++`` on PATH that links the shared library."""
    current = os.environ.get("CXX", "c++")
    if _shared_libstdcxx(current):
        return None
    for name in ("c++", "g++"):
        path = shutil.which(name)
        if path and _shared_libstdcxx(path):
            log.warning("kvgate: %s would link libstdc++ statically into the CPU kernels; building with %s",
                        current, path)
            return path
    return None


@contextmanager
def _compiler_env() -> Iterator[None]:
    """``CXX`` set to ``cxx_compiler()`` for the duration of a build (torch reads it when it writes build.ninja)."""
    cxx, before = cxx_compiler(), os.environ.get("CXX")
    if cxx is not None:
        os.environ["CXX"] = cxx
    try:
        yield
    finally:
        if cxx is not None:
            if before is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = before


def _native(cflags: list[str]) -> bool:
    return any("march=native" in f for f in cflags)


def build_key(sources: list[Path], headers: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    """A digest of everything the binary depends on."""
    import torch

    h = hashlib.sha256()
    for p in [*sources, *headers]:
        # The full path, not only the name: torch's build.ninja names the sources by path, so two checkouts
        # sharing one directory would each find the other's build out of date and rebuild it in turn.
        h.update(str(p.resolve()).encode())
        h.update(p.read_bytes())
    h.update(repr((cflags, ldflags, torch.__version__, sys.version_info[:2])).encode())
    cxx = cxx_compiler()
    if cxx is not None:  # only where $CXX is replaced, so other machines keep their keys
        h.update(f"cxx={cxx}".encode())
    if _native(cflags):
        h.update(cpu_identity().encode())
    return h.hexdigest()[:16]


def build_dir(name: str, key: str) -> Path:
    return extensions_root() / f"{name}-{key}"


def _acquire(lock_path: Path, timeout_s: float) -> int:
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise BuildLockTimeout(f"build lock {lock_path} still held after {timeout_s:.0f} s") from None
            time.sleep(_POLL_S)


def load_extension(name: str, sources: list[Path], *, headers: list[Path] | None = None,
                   cflags: list[str], ldflags: list[str]) -> Any:
    """Build (once per content key) and import the extension; raises on failure or lock timeout."""
    from torch.utils.cpp_extension import load as _load

    headers = headers or []
    key = build_key(sources, headers, cflags, ldflags)
    out = build_dir(name, key)
    out.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get("KVGATE_KERNEL_BUILD_TIMEOUT", "600"))
    fd = _acquire(out.parent / f"{name}-{key}.flock", timeout_s)
    try:
        stale = out / "lock"  # torch's FileBaton file: nobody else can be inside this directory now
        if stale.exists():
            stale.unlink()
        if _native(cflags):
            stamp = out / CPU_STAMP
            built_for = stamp.read_text() if stamp.exists() else cpu_identity()
            if built_for != cpu_identity():
                first = (built_for.splitlines() or [""])[0]
                raise RuntimeError(f"{out} was built for another CPU ({first!r}); not loading it")
            stamp.write_text(cpu_identity())
        include = sorted({str(p.parent) for p in headers})
        with _compiler_env():
            return _load(name=name, sources=[str(s) for s in sources], extra_include_paths=include,
                         extra_cflags=cflags, extra_ldflags=ldflags, build_directory=str(out), verbose=False)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
