"""The decode-step layer stack (``decode_stack.cpp``): every decoder layer of a step in one C++ call, running the
other CPU kernel modules' own functions (their ``api()`` tables, kernel_api.h), so it needs all three built.
``KVGATE_CPU_KERNEL=0`` or ``KVGATE_DECODE_STACK=0`` switches it off (the model's module path runs every step)."""

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
        from kernels_cupy.cpu import load as load_attention
        from kernels_cupy.cpu.build import load_extension
        from kernels_cupy.cpu.fused import load_fused
        from kernels_cupy.cpu.qgemm import load_qgemm

        # Glue only (the kernels are the modules'): no -march=native, no OpenMP of its own. Built before the three
        # modules are loaded: it reaches them only through the tables bound below, so its build need not wait on
        # theirs, and a build of all four (prebuild, the wheel test) runs it beside them instead of after (Zen 4:
        # 45 -> 42-44 s for prebuild's four). Where one of them cannot be built, the glue is built for nothing, once.
        src, *included = build_files(_DIR / "decode_stack.cpp")
        mod = load_extension("kvgate_cpu_decode_stack", [src], headers=included, cflags=["-O3", "-ffp-contract=off"],
                             ldflags=[])
        gemm, attention, fused = load_qgemm(), load_attention(), load_fused()
        if gemm is None or attention is None or fused is None:
            missing = [name for name, m in (("quantized GEMM", gemm), ("paged attention", attention),
                                              ("fused ops", fused)) if m is None]
            raise RuntimeError(f"the stack runs their kernels, and these are not built: {', '.join(missing)}")
        mod.bind(gemm.api(), attention.api(), fused.api())
        return mod
    except Exception as e:  # noqa: BLE001 - any build failure means: the module path runs
        log.warning("CPU decode stack unavailable (%s); decode steps run the model's modules", e)
        return None
