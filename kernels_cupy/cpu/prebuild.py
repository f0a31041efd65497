"""Build every C++ CPU kernel now (``make setup`` runs this), so no worker compiles one while it starts.

A worker that finds a kernel unbuilt compiles it inside its start-up (50-80 s on a 2-core Zen 1/Zen 3), which
is time a gateway, a test fixture or an operator waits on with no output. Building here, once per content key
(``build.py``), moves that cost to setup; a later start only imports the finished module (well under a second).
A kernel that cannot be built is reported and left to its fallback path; setup does not fail on it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any


def _loaders() -> list[tuple[str, Callable[[], Any | None]]]:
    from kernels_cupy.cpu import load
    from kernels_cupy.cpu.fused import load_fused
    from kernels_cupy.cpu.qgemm import load_qgemm
    from kernels_cupy.cpu.stack import load_stack

    return [("paged attention", load), ("quantized GEMM", load_qgemm), ("fused decoder ops", load_fused),
            ("decode layer stack", load_stack)]


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for label, loader in _loaders():
        t0 = time.monotonic()
        mod = loader()
        state = "ready" if mod is not None else "unavailable (the fallback path will run)"
        print(f"kvgate: CPU kernel {label}: {state} in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
