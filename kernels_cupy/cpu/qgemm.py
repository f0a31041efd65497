"""The block-quantized GEMM (``qgemm.cpp``), built once with torch's cpp_extension like the attention kernel.

One binary carries AVX-512 VNNI, AVX2 and scalar paths and picks one at run time from the CPU's features,
so a build cache shared between machines never runs an instruction the CPU lacks (no ``-march=native``).
``KVGATE_CPU_KERNEL=0`` switches it off (the quantized linears then fall back to de-quantized fp32 weights).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels_cupy.cpu.sources import build_files

log = logging.getLogger(__name__)
_DIR = Path(__file__).parent


def qgemm_files() -> list[Path]:
    """The GEMM's source, then every header it includes (its build key)."""
    return build_files(_DIR / "qgemm.cpp")


@functools.lru_cache(maxsize=1)
def load_qgemm() -> Any | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if os.environ.get("KVGATE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from kernels_cupy.cpu.build import load_extension

        src, *headers = qgemm_files()
        mod = load_extension("kvgate_cpu_qgemm", [src], headers=headers,
                             cflags=["-O3", "-ffp-contract=off", "-fopenmp"],  # contract off: see build.NATIVE_CFLAGS
                             ldflags=["-fopenmp"])
        log.info("quantized GEMM kernel: %s path", mod.isa())
        return mod
    except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback path
        log.warning("quantized GEMM kernel unavailable (%s); quantized linears use de-quantized weights", e)
        return None
