"""A C++ paged-decode attention kernel for the CPU, built once with torch's cpp_extension (gcc, ninja).

It is an accelerator for the torch reference, never a replacement: where it cannot be built (no compiler,
no ninja) or is switched off with ``KVGATE_CPU_KERNEL=0``, the reference path runs, and the tests compare
the two. The build is cached under ``TORCH_EXTENSIONS_DIR/kvgate`` (default ``~/.cache/torch_extensions``), one directory
per content key, behind a lock that a killed build cannot leave stale (``build.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels_cupy.cpu.sources import build_files

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("paged_decode.cpp")


def paged_decode_files() -> list[Path]:
    """The attention kernel's source, then every header it includes (its build key)."""
    return build_files(_SRC)


@functools.lru_cache(maxsize=1)
def load() -> Any | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if os.environ.get("KVGATE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from kernels_cupy.cpu.build import NATIVE_CFLAGS, load_extension

        src, *headers = paged_decode_files()
        return load_extension("kvgate_cpu_paged_decode", [src], headers=headers, cflags=list(NATIVE_CFLAGS),
                              ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference path
        log.warning("CPU paged-decode kernel unavailable (%s); using the torch reference path", e)
        return None


def cpu_backend_or_reference() -> Any:
    """The fastest CPU attention backend available here."""
    from kernels_cupy.cpu.backend import CpuAttentionBackend
    from kernels_cupy.torch_ref import TorchAttentionBackend

    mod = load()
    return CpuAttentionBackend(mod) if mod is not None else TorchAttentionBackend()
