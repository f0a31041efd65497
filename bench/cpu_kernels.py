"""CPU kernel micro-benchmarks at SmolLM2's shapes, same invocation, fixed seeds:

1. paged decode attention (9 query / 3 KV heads, head size 64, blocks of 16, shuffled block table): the
   portable loops (``set_kv_isa("scalar")``) against the AVX2 body (``"auto"``), per KV dtype, threads and
   (sequences x context); microseconds per call, best of --repeats;
2. the prefill crossover of workers/models/linear.py's DENSE_MIN_ROWS: the block kernel (``qlinear``, int8
   activations) against de-quantizing into a buffer + torch's fp32 GEMM, per layer shape and rows.

    .venv/bin/python bench/cpu_kernels.py [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels_cupy import kv_quant
from kernels_cupy.cpu import load
from kernels_cupy.cpu.qgemm import load_qgemm
from workers.models.quant import quantize

LAYERS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_us(fn: Callable[[], object], repeats: int, calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return min(times) * 1e6


def attention(mod: object, threads: list[int], repeats: int) -> None:
    print("| KV dtype | threads | seqs x context | portable us | AVX2 body us | speed-up |\n|---|---:|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    for dtype in (torch.float32, torch.int8):
        for th in threads:
            torch.set_num_threads(th)
            for n, ctx in ((1, 256), (1, 1024), (16, 320)):
                nb = n * (-(-ctx // bs)) + 1
                k, v = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
                if dtype == torch.int8:
                    k, v = kv_quant.quantize(k), kv_quant.quantize(v)
                table = torch.randperm(nb - 1, generator=g).add(1).to(torch.int32).reshape(n, -1)
                lens = torch.full((n,), ctx, dtype=torch.int32)
                q = torch.randn(n, hq, d, generator=g)
                us = {}
                for isa in ("scalar", "auto"):
                    mod.set_kv_isa(isa)  # type: ignore[attr-defined]
                    us[isa] = best_us(lambda: mod.paged_decode(q, k, v, table, lens, 0.125), repeats)  # type: ignore[attr-defined]
                mod.set_kv_isa("auto")  # type: ignore[attr-defined]
                print(f"| {str(dtype).split('.')[1]} | {th} | {n} x {ctx} | {us['scalar']:.1f} | {us['auto']:.1f} | "
                      f"{us['scalar'] / us['auto']:.2f}x |")


def prefill(qg: object, threads: list[int], repeats: int) -> None:
    print("\n| threads | layer (N, K) | rows | block kernel us | de-quantize + fp32 GEMM us | dense / kernel speed |\n"
          "|---:|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(1)
    buf = torch.empty(max(n * k for n, k in LAYERS.values()))
    for th in threads:
        torch.set_num_threads(th)
        for name, (n, k) in LAYERS.items():
            w = quantize(torch.randn(n, k, generator=g) * 0.05, 4)
            d, m = w.d.half(), None if w.m is None else w.m.half()
            for rows in (16, 64, 128, 256, 512):
                x = torch.randn(rows, k, generator=g)
                a = best_us(lambda: qg.qlinear(x, w.codes, d, m, None, 4), repeats, 5)  # type: ignore[attr-defined]
                b = best_us(lambda: F.linear(x, qg.dequant(w.codes, d, m, 4, buf)), repeats, 5)  # type: ignore[attr-defined]
                print(f"| {th} | {name} ({n}, {k}) | {rows} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    mod, qg = load(), load_qgemm()
    if mod is None or qg is None:
        raise SystemExit("the CPU kernels did not build here (see the log); nothing to measure")
    attention(mod, threads, a.repeats)
    prefill(qg, threads, a.repeats)


if __name__ == "__main__":
    main()
