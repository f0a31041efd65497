"""The A16 GEMM compiled with the GEMM module's flags, with the attention's native flags (``build.NATIVE_CFLAGS``)
and with ``-march=native`` alone, timed in one sitting.

Why: the decode stack, which runs every prefill and decode step's GEMMs, used to compile its own copy of the kernel
with the attention's native flags. On a Zen 4 with GCC 12, ``-march=native`` alone (tuned for znver3) ran the VNNI
lane kernel 25-40% slower than the GEMM module's build, and nothing but a step's time showed it; with generic
tuning it was still up to 5% slower (bench/RESULTS.md, twenty-third session). The stack now calls the GEMM module's own
kernel (kernels_cupy/cpu/kernel_api.h). Run this before building any kernel with native flags on a new CPU or
compiler.

    .venv/bin/python bench/build_tuning.py [--bits 4] [--rounds 3] [--isa vnni256]

Compiles ``bench/qgemm16_harness.cpp`` (one thread, in cache, every result checked bit for bit against the scalar
reference; the packed codes' rate, which a model runs, where the path has one) once per flag set, runs them
alternately ``--rounds`` times, and prints each (shape, M)'s best GMAC/s per build and its ratio to the module's
build. ``--isa`` sets ``KVGATE_QGEMM_ISA`` (default: the run-time pick).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kernels_cupy.cpu.build import NATIVE_CFLAGS  # noqa: E402
from peer_servers import cpu_line  # noqa: E402

BUILDS = {  # name -> compiler flags (OpenMP left out: the harness is one thread)
    "module": ["-O3", "-ffp-contract=off"],
    "native (attention's flags)": [f for f in NATIVE_CFLAGS if f != "-fopenmp"],
    "native, CPU tuning": ["-O3", "-march=native", "-ffp-contract=off"],
}


def run(binary: Path, bits: int, env: dict[str, str]) -> dict[tuple[int, int, int], float]:
    """(N, K, M) -> GMAC/s of one harness run; raises where any result differs from the scalar reference."""
    out = subprocess.run([str(binary), str(bits), "4"], capture_output=True, text=True, env=env, check=True).stdout
    if "MISMATCH" in out:
        raise SystemExit(f"{binary}: a result differs from the scalar reference:\n{out}")
    rates = {}
    for ln in out.splitlines():
        f = ln.replace("=", " ").split()
        if len(f) > 8 and f[0] == "N":  # N= 960 K= 576 M= 512  4.087 ms  69.3 GMAC/s  packed  68.2 GMAC/s  ok
            # The packed codes' rate where the path has one: that is what a model's linears run (wlanes).
            rates[int(f[1]), int(f[3]), int(f[5])] = float(f[11] if len(f) > 11 and f[10] == "packed" else f[8])
    return rates


def harness_args(doc: str) -> tuple[argparse.Namespace, dict[str, str]]:
    """The harness benches' command line (--bits, --rounds, --isa) and the environment the harness runs in."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", default="", help="KVGATE_QGEMM_ISA for the harness (default: the run-time pick)")
    args = ap.parse_args()
    return args, dict(os.environ, **({"KVGATE_QGEMM_ISA": args.isa} if args.isa else {}))


def main() -> None:
    args, env = harness_args(__doc__ or "")
    with tempfile.TemporaryDirectory() as tmp:
        bins = {}
        for i, (name, flags) in enumerate(BUILDS.items()):
            bins[name] = Path(tmp) / f"h{i}"
            subprocess.run(["g++", *flags, "-std=c++17", f"-I{REPO / 'kernels_cupy/cpu'}",
                            str(REPO / "bench/qgemm16_harness.cpp"), "-o", str(bins[name])], check=True)
        best: dict[str, dict[tuple[int, int, int], float]] = {name: {} for name in BUILDS}
        for _ in range(args.rounds):
            for name, binary in bins.items():
                for key, rate in run(binary, args.bits, env).items():
                    best[name][key] = max(best[name].get(key, 0.0), rate)
    print(f"CPU: {cpu_line()}; {args.bits}-bit weights; KVGATE_QGEMM_ISA={args.isa or '(run-time pick)'}; "
          f"best of {args.rounds} alternating rounds, GMAC/s (one thread)\n")
    names = list(BUILDS)
    print("| (N, K) | M | " + " | ".join(names) + " | " + " | ".join(f"{n} / module" for n in names[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(names) - 1))
    for (n, k, m), base in sorted(best["module"].items()):
        rates = [best[name].get((n, k, m), 0.0) for name in names]
        ratios = [f"{r / base:.2f}x" for r in rates[1:]]
        print(f"| ({n}, {k}) | {m} | " + " | ".join(f"{r:.1f}" for r in rates) + " | " + " | ".join(ratios) + " |")
    print("\nFlags: " + "; ".join(f"{name}: {' '.join(flags)}" for name, flags in BUILDS.items()))


if __name__ == "__main__":
    main()
