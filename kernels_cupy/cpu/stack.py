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
        from kernels_cupy.cpu.build import load_extension

        included = ["qgemm.cpp", "paged_decode.cpp", "fused_ops.cpp", "paged_decode_avx2.h", "paged_decode_avx512.h",
                    "simd_exp.h", "kv_write.h", "fgemm.h", "lora_add.h"]
        # Every qgemm*.h as load_qgemm globs them: a header the GEMM gains is part of the build key here too.
        return load_extension("kvgate_cpu_decode_stack", [_DIR / "decode_stack.cpp"],
                              headers=[_DIR / s for s in included] + sorted(_DIR.glob("qgemm*.h")),
                              cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: the module path runs
        log.warning("CPU decode stack unavailable (%s); decode steps run the model's modules", e)
        return None
