"""Interactive latency beside a batch job (issue 26's latency goal), measured: one invocation, one deployment.

    .venv/bin/python bench/batch_interactive.py [--model smollm2] [--seed 0] [--rate 0.5] [--requests 40] \\
        [--capacity-window 40] [--json-out out.json]

Runs the ``batch-interactive`` drill (chaos/drills/batch_interactive.py: the phases and how each number is
counted are described there) on a fresh ``kvgate serve --workers 1`` and prints a markdown table for
bench/RESULTS.md: interactive TTFT p50/p99 on the idle worker and beside the batch, the batch's output tokens/s
alone and beside, the capacity the interactive load leaves, and the goal's two ratios. Every ratio compares
numbers of this one invocation. Seeds are fixed (``--seed``: the arrival schedule and every prompt); the CPU is
named from lscpu and the load average is printed before and after, since a busy machine skews TTFT first.
``--quick`` is the CI size (tiny random model, steps held 5 ms): it exercises the path, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import ClassVar

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from chaos.drills.batch_interactive import BatchInteractive, MixSizes  # noqa: E402
from chaos.runner import RunOptions, run_drills  # noqa: E402
from peer_servers import cpu_line  # noqa: E402

ROWS = [  # (label, measurement key, unit)
    ("interactive TTFT p50, idle worker", "ttft_idle_p50_ms", "ms"),
    ("interactive TTFT p90, idle worker", "ttft_idle_p90_ms", "ms"),
    ("interactive TTFT p99, idle worker", "ttft_idle_p99_ms", "ms"),
    ("interactive TTFT p50, beside the batch", "ttft_beside_p50_ms", "ms"),
    ("interactive TTFT p90, beside the batch", "ttft_beside_p90_ms", "ms"),
    ("interactive TTFT p99, beside the batch", "ttft_beside_p99_ms", "ms"),
    ("**TTFT p99 beside / idle** (goal <= 1.25)", "ttft_p99_ratio", "x"),
    ("interactive output, idle / beside", "interactive_tok_s_idle", "tok/s"),
    ("batch output alone (the worker's capacity for it)", "batch_alone_tok_s", "tok/s"),
    ("batch output beside the interactive load", "batch_beside_tok_s", "tok/s"),
    ("capacity the interactive load leaves (alone - interactive beside)", "capacity_left_tok_s", "tok/s"),
    ("**batch beside / capacity left** (goal >= 0.90)", "batch_share_of_left", ""),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default=None, help="default: tiny with --quick, else smollm2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=None, help="interactive arrivals per second")
    p.add_argument("--requests", type=int, default=None, help="interactive requests per phase")
    p.add_argument("--capacity-window", type=float, default=None, help="seconds of the batch-alone window")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `kvgate serve` flag (repeat), e.g. "
                   "--serve-arg=--max-num-batched-tokens --serve-arg=128")
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()
    base = BatchInteractive.SIZES[a.quick]
    sizes = dataclasses.replace(base, rate=a.rate or base.rate, requests=a.requests or base.requests,
                                capacity_window_s=a.capacity_window or base.capacity_window_s)

    class Sized(BatchInteractive):
        SIZES: ClassVar[dict[bool, MixSizes]] = {a.quick: sizes}
        SERVE_ARGS: ClassVar[tuple[str, ...]] = tuple(a.serve_arg)

    cpu, load_before, started = cpu_line(), os.getloadavg(), time.time()
    [result] = trio.run(run_drills, [Sized()], RunOptions(quick=a.quick, model=a.model, seed=a.seed))
    load_after = os.getloadavg()
    m = result.measurements
    print(f"\nCPU: {cpu}\nload average before {_load(load_before)}, after {_load(load_after)}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {result.seconds:.0f} s, seed {a.seed}")
    print(f"load: {result.load}" + (f"; serve flags {' '.join(a.serve_arg)}" if a.serve_arg else "") + "\n")
    print("| measure | value |\n|---|---:|")
    for label, key, unit in ROWS:
        value = m.get(key)
        if key == "interactive_tok_s_idle":
            value = f"{m.get(key)} / {m.get('interactive_tok_s_beside')}"
        print(f"| {label} | {value} {unit} |")
    print(f"\nverdict: {result.verdict}; " + "; ".join(f"{c.name}: {c.status} ({c.detail})" for c in result.checks
                                                    if c.name.startswith(("interactive TTFT", "batch output"))))
    print("TTFT ms, idle:  ", result.details.get("ttft_idle_ms"))
    print("TTFT ms, beside:", result.details.get("ttft_beside_ms"))
    if result.error:
        print(f"error: {result.error}")
    if a.json_out is not None:
        a.json_out.write_text(json.dumps({"cpu": cpu, "load_before": load_before, "load_after": load_after,
                                          "seed": a.seed, "result": result.to_json()}, indent=2) + "\n")
    return 0 if result.error is None else 1


def _load(avg: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in avg)


if __name__ == "__main__":
    sys.exit(main())
