"""Decode tok/s of the offline engine three ways, same process, interleaved (issue 11's lean decode step):
the C++ decode stack (every decoder layer of a decode-only step in one call, decode_stack.cpp), the model's
modules with the fused C++ layer ops, and the modules with the torch reference ops.
Usage: .venv/bin/python bench/fused_decode.py [--quantization int4] [--repeats 3]"""

from __future__ import annotations

import argparse
import time

from workers import LLM, SamplingParams
from workers.models.fused import REFERENCE


def run(llm: LLM, batch: int, out: int) -> float:
    prompts = [[100 + i + j for j in range(64)] for i in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    return batch * out / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    llm = LLM("smollm2", quantization=a.quantization, kv_cache_tokens=8192)
    model = llm.engine.runner.model
    fused, stack = model.ops, model.decode_stack()
    if stack is None:
        print("the decode stack is not available here (KVGATE_DECODE_STACK=0 or a failed build): its column is 0")
    modes = {"stack": (fused, stack), "fused": (fused, None), "reference": (REFERENCE, None)}
    for batch, out in ((1, 48), (16, 32)):
        best = dict.fromkeys(modes, 0.0)
        for _ in range(a.repeats):
            for name, (ops, stk) in modes.items():
                if name == "stack" and stk is None:
                    continue
                model.ops, model._stack = ops, stk
                best[name] = max(best[name], run(llm, batch, out))
        print(f"{a.quantization} batch {batch}: decode stack {best['stack']:.1f} tok/s, fused ops "
              f"{best['fused']:.1f}, reference ops {best['reference']:.1f}; stack / fused "
              f"{best['stack'] / best['fused']:.2f}x, fused / reference {best['fused'] / best['reference']:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
