"""Micro-benchmark of the fixed-order fp32 linear (``flinear``, kernels_cupy/cpu/fgemm.h) against torch's F.linear.

SmolLM2-135M's projection shapes, M = 1, 16, 64, 256, 512 rows. Each entry is the minimum over repeats of the
mean of a few back-to-back calls (min of repeats: the least disturbed measurement of the same work), the two
functions taking turns. On a shared machine check `uptime` first: other work on the cores skews both.

    python bench/flinear_micro.py [--threads 2] [--repeats 7] [--m 1,16,64] [--clock cpu --threads 1]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.strip().startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def ms_per_call(fns: list[Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter,
                budget_s: float = 0.05) -> list[float]:
    """Per function, the minimum over `repeats` of the mean time of n calls (n sized so one repeat takes
    ~budget_s). The functions take turns within each repeat, so a burst of load from elsewhere on the machine
    hits all of them alike instead of one."""
    ns = []
    for fn in fns:
        fn()  # warm: page in the output, spin up the thread pool
        t = clock()
        fn()
        ns.append(max(1, min(200, int(budget_s / max(clock() - t, 1e-6)))))
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, (fn, n) in enumerate(zip(fns, ns)):
            t = clock()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (clock() - t) / n)
    return [b * 1e3 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--m", default="1,16,64,256,512", help="comma-separated row counts")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from " + ",".join(SHAPES))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time, which other work on a busy machine barely moves; "
                         "meaningful with --threads 1 only (with more it counts the pool's spin-waits too)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    from kernels_cupy.cpu.qgemm import load_qgemm

    mod = load_qgemm()
    if mod is None or not hasattr(mod, "flinear"):
        raise SystemExit("the CPU kernel module (with flinear) is not available")
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_model()}  threads: {torch.get_num_threads()}  clock: {args.clock}  flinear path: {mod.fgemm_isa()}")
    print(f"{'shape':8} {'(N, K)':>12} {'M':>4} {'F.linear ms':>12} {'flinear ms':>11} {'speed vs F.linear':>18}")
    g = torch.Generator().manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, generator=g) / k ** 0.5
        for m in (int(s) for s in args.m.split(",")):
            x = torch.randn(m, k, generator=g)
            ref, got = ms_per_call([lambda: F.linear(x, w), lambda: mod.flinear(x, w, None)], args.repeats,
                                   clock)
            print(f"{name:8} {str((n, k)):>12} {m:>4} {ref:>12.3f} {got:>11.3f} {ref / got:>17.2f}x")


if __name__ == "__main__":
    main()
