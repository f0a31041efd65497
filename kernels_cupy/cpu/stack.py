"""The decode-step layer stack (``decode_stack.cpp``): every decoder layer of a decode-only step in one C++
call, built from the other CPU kernels' own sources like them (``build.py``). ``KVGATE_CPU_KERNEL=0`` or
``KVGATE_DECODE_STACK=0`` switches it off (the model's module path runs every step instead)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels_cupy.cpu.sources import build_files

log = logging.getLogger(__name__)
_DIR = Path(__file__).parent


@functools.lru_cache(maxsize=1)
def load_stack() -> Any | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if os.environ.get("KVGATE_CPU_KERNEL", "1") == "0" or os.environ.get("KVGATE_DECODE_STACK", "1") == "0":
        return None
    try:
        from kernels_cupy.cpu.build import NATIVE_CFLAGS, load_extension

        # decode_stack.cpp compiles the three kernels' sources in one unit: they and their headers are its includes.
        # The attention's native flags, generic tuning included (build.py: the GEMMs' speed depends on it).
        src, *included = build_files(_DIR / "decode_stack.cpp")
        return load_extension("kvgate_cpu_decode_stack", [src], headers=included, cflags=list(NATIVE_CFLAGS),
                              ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: the module path runs
        log.warning("CPU decode stack unavailable (%s); decode steps run the model's modules", e)
        return None
