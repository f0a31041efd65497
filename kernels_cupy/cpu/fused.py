"""The fused decoder-layer ops (``fused_ops.cpp``: RMSNorm with its residual add, rope in place, SiLU*up),
built like the other CPU kernels (``build.py``). ``KVGATE_CPU_KERNEL=0`` switches them off (the torch
references in ``workers.models.fused`` run instead)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

from kernels_cupy.cpu.sources import build_files

log = logging.getLogger(__name__)


def fused_files() -> list[Path]:
    """The fused ops' source, then every header it includes (its build key)."""
    return build_files(Path(__file__).with_name("fused_ops.cpp"))


@functools.lru_cache(maxsize=1)
def load_fused() -> Any | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if os.environ.get("KVGATE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from kernels_cupy.cpu.build import load_extension

        # -ffp-contract=off: no fused multiply-adds, so rope rounds like the torch reference, op for op. OpenMP:
        # at::parallel_for is inline OpenMP, so without it the ops run on one thread (the decode stack calls these).
        src, *headers = fused_files()
        return load_extension("kvgate_cpu_fused_ops", [src], headers=headers,
                              cflags=["-O3", "-ffp-contract=off", "-fopenmp"], ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: use the reference path
        log.warning("fused CPU ops unavailable (%s); using the torch reference ops", e)
        return None
