"""CPU kernel micro-benchmark at SmolLM2's shapes, same invocation, fixed seeds: paged decode attention (9 query /
3 KV heads, head size 64, blocks of 16, shuffled block table), the portable loops (``set_kv_isa("scalar")``) against
the AVX2 body and, where the CPU has it, the AVX-512 one, per KV dtype, threads and (sequences x context);
microseconds per call, best of --repeats. (Its second table, the block kernel against de-quantized fp32 GEMM for long prefill chunks, went with
that switch: every row count now runs the block kernel; bench/qlinear_micro.py compares the linears.)

    .venv/bin/python bench/cpu_kernels.py [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels_cupy import kv_quant
from kernels_cupy.cpu import load


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
    isas = ["scalar", "avx2", "avx512"]
    try:
        mod.set_kv_isa("avx512")  # type: ignore[attr-defined]
    except RuntimeError:
        isas.pop()  # no AVX-512 body on this CPU
    mod.set_kv_isa("auto")  # type: ignore[attr-defined]
    print("| KV dtype | threads | seqs x context | " + " | ".join(f"{i} us" for i in isas)
          + " | speed-up of the fastest |\n|---|---:|---|" + "---:|" * (len(isas) + 1))
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 9, 3, 64, 16
    for dtype in (torch.float32, torch.float16, torch.int8):
        for th in threads:
            torch.set_num_threads(th)
            for n, ctx in ((1, 256), (1, 1024), (16, 320), (32, 300)):
                nb = n * (-(-ctx // bs)) + 1
                k, v = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
                k, v = kv_quant.to_cache(k, dtype), kv_quant.to_cache(v, dtype)
                table = torch.randperm(nb - 1, generator=g).add(1).to(torch.int32).reshape(n, -1)
                lens = torch.full((n,), ctx, dtype=torch.int32)
                q = torch.randn(n, hq, d, generator=g)
                us = {}
                for isa in isas:
                    mod.set_kv_isa(isa)  # type: ignore[attr-defined]
                    us[isa] = best_us(lambda: mod.paged_decode(q, k, v, table, lens, 0.125), repeats)  # type: ignore[attr-defined]
                mod.set_kv_isa("auto")  # type: ignore[attr-defined]
                cells = " | ".join(f"{us[i]:.1f}" for i in isas)
                print(f"| {str(dtype).split('.')[1]} | {th} | {n} x {ctx} | {cells} | "
                      f"{us['scalar'] / min(us.values()):.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    mod = load()
    if mod is None:
        raise SystemExit("the CPU kernels did not build here (see the log); nothing to measure")
    attention(mod, threads, a.repeats)


if __name__ == "__main__":
    main()
