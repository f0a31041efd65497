"""Build every C++ CPU kernel now (``make setup`` runs this), so no worker compiles one while it starts.

A worker that finds a kernel unbuilt compiles it inside its start-up (25-75 s on a 2-core Zen 1), which
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


def _loaders() -> dict[str, Callable[[], Any | None]]:
    """Each kernel's loader by its label, longest build first (Zen 4, two at once: GEMM 28 s, attention 18, the
    decode stack's glue 14, fused 11), so that two cores end together. The stack builds its glue first and then
    loads (and waits for) the other three, whose functions it calls; the fused ops go last, since the stack's
    process builds them itself if it gets there first (a build lock keeps it to one build)."""
    from kernels_cupy.cpu import load
    from kernels_cupy.cpu.fused import load_fused
    from kernels_cupy.cpu.qgemm import load_qgemm
    from kernels_cupy.cpu.stack import load_stack

    return {"quantized GEMM": load_qgemm, "paged attention": load, "decode layer stack": load_stack,
            "fused decoder ops": load_fused}


def _build(label: str) -> tuple[bool, float]:
    """In a child process: build (or find built) the kernel ``label``; whether it loads, and the seconds it took."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    t0 = time.monotonic()
    mod = _loaders()[label]()
    return mod is not None, time.monotonic() - t0


def main() -> int:
    # One process per kernel, as many at once as there are cores: each build compiles one C++ file on one core
    # (the four took 331 s one after another on a 2-core Zen 1). Each holds its own build lock (build.py), and
    # spawned children do not inherit this process's state.
    labels = list(_loaders())
    workers = max(1, min(len(labels), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_build, label): label for label in labels}
        for future in as_completed(futures):
            ok, seconds = future.result()
            state = "ready" if ok else "unavailable (the fallback path will run)"
            print(f"kvgate: CPU kernel {futures[future]}: {state} in {seconds:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
