"""Micro-benchmark of the linear-layer candidates at SmolLM2's shapes on this CPU: fp32 F.linear, fbgemm's
prepacked dynamic int8 (torch.ops.quantized.linear_dynamic) and our block-quantized kernel (q4 = GGUF Q4_1,
q8 = Q8_0) with int8 activations (A8, act_bits=8) and int16 activations (A16, act_bits=16, the default
arithmetic). Prints ms per call and speed-up over fp32 for each (M, N, K); ratios are from this run only.
fp32 runs F.linear on the de-quantized Q4 weights (the same tensor sizes as the model's fp32 mode).

    .venv/bin/python bench/qlinear_micro.py [--threads 2] [--ms 1,16,64,256,512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels_cupy.cpu.qgemm import load_qgemm
from workers.models.quant import dequantize, quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timeit(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """Fastest call in ms: the code's own speed, robust to other processes taking the cores."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,16,64,256,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mod = load_qgemm()
    print(f"torch {torch.__version__}, threads {a.threads}, kernel path {mod.isa() if mod else 'none'}")
    print(f"{'shape':8} {'M':>4} {'fp32 ms':>8} {'fbgemm8':>8} {'q8 A8':>8} {'q4 A8':>8} {'q8 A16':>8} {'q4 A16':>8}"
          "  speed-up over fp32: fbgemm / q8 A8 / q4 A8 / q8 A16 / q4 A16")
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k) * 0.05
        q8, q4 = quantize(w, 8), quantize(w, 4)
        w = dequantize(q4)
        packed = torch.ops.quantized.linear_prepack(
            torch.quantize_per_channel(w, (w.abs().amax(1) / 127).clamp_min(1e-8), torch.zeros(n, dtype=torch.long),
                                       0, torch.qint8), None)
        for m in (int(x) for x in a.ms.split(",")):
            x = torch.randn(m, k)
            t32 = timeit(lambda: F.linear(x, w))
            tfb = timeit(lambda: torch.ops.quantized.linear_dynamic(x, packed, True))
            ts = [timeit(lambda: mod.qlinear(x, q.codes, q.d, q.m, None, q.bits, None, act)) if mod else float("nan")
                  for act in (8, 16) for q in (q8, q4)]
            print(f"{name:8} {m:4d} {t32:8.3f} {tfb:8.3f} " + " ".join(f"{t:8.3f}" for t in ts) + "  "
                  + " ".join(f"{t32 / t:5.2f}x" for t in (tfb, *ts)))


if __name__ == "__main__":
    main()
