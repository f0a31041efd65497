"""Build every C++ CPU kernel now (``make setup`` runs this), so no worker compiles one while it starts.

A worker that finds a kernel unbuilt compiles it inside its start-up (50-80 s on a 2-core Zen 1/Zen 3), which
is time a gateway, a test fixture or an operator waits on with no output. Building here, once per content key
(``build.py``), moves that cost to setup; a later start only imports the finished module (well under a second).
A kernel that cannot be built is reported and left to its fallback path; setup does not fail on it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

LABELS = ("paged attention", "quantized GEMM", "fused decoder ops", "decode layer stack")


def _loaders() -> list[Callable[[], Any | None]]:
    from kernels_cupy.cpu import load
    from kernels_cupy.cpu.fused import load_fused
    from kernels_cupy.cpu.qgemm import load_qgemm
    from kernels_cupy.cpu.stack import load_stack

    return [load, load_qgemm, load_fused, load_stack]  # in LABELS' order


def _build(index: int) -> tuple[bool, float]:
    """In a child process: build (or find built) kernel ``index``; whether it loads, and the seconds it took."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    t0 = time.monotonic()
    mod = _loaders()[index]()
    return mod is not None, time.monotonic() - t0


def main() -> int:
    # One process per kernel, as many at once as there are cores: each build compiles one C++ file on one core
    # (the four took 331 s one after another on a 2-core Zen 1). Each holds its own build lock (build.py), and
    # spawned children do not inherit this process's state.
    workers = max(1, min(len(LABELS), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Longest first (Zen 1: stack 103 s, GEMM 93, attention 72, fused 60), so two cores end together.
        futures = {pool.submit(_build, i): LABELS[i] for i in (3, 1, 0, 2)}
        for future in as_completed(futures):
            ok, seconds = future.result()
            state = "ready" if ok else "unavailable (the fallback path will run)"
            print(f"kvgate: CPU kernel {futures[future]}: {state} in {seconds:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
