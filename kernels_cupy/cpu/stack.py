"""The decode-step layer stack (``decode_stack.cpp``): every decoder layer of a decode-only step in one C++
call, built from the other CPU kernels' own sources like them (``build.py``). ``KVGATE_CPU_KERNEL=0`` or
``KVGATE_DECODE_STACK=0`` switches it off (the model's module path runs every step instead)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_DIR = Path(__file__).parent


@functools.lru_cache(maxsize=1)
def load_stack() -> Any | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if os.environ.get("KVGATE_CPU_KERNEL", "1") == "0" or os.environ.get("KVGATE_DECODE_STACK", "1") == "0":
        return None
    try:
        from kernels_cupy.cpu import paged_decode_files
        from kernels_cupy.cpu.build import load_extension
        from kernels_cupy.cpu.fused import fused_files
        from kernels_cupy.cpu.qgemm import qgemm_files

        # decode_stack.cpp compiles the three kernels' sources in one unit: their own file lists, each file once,
        # so a header a kernel gains is part of this build key too.
        included = list(dict.fromkeys([*qgemm_files(), *paged_decode_files(), *fused_files()]))
        return load_extension("kvgate_cpu_decode_stack", [_DIR / "decode_stack.cpp"], headers=included,
                              cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: the module path runs
        log.warning("CPU decode stack unavailable (%s); decode steps run the model's modules", e)
        return None
