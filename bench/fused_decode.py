"""Decode tok/s of the offline engine with the fused C++ layer ops against the torch reference ops, same
process, interleaved (issue 11's lean decode step). Usage: .venv/bin/python bench/fused_decode.py [--quantization int4]"""

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
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    fused = model.ops
    for batch, out in ((1, 48), (16, 32)):
        best: dict[str, float] = {"fused": 0.0, "reference": 0.0}
        for _ in range(a.repeats):
            for name, ops in (("fused", fused), ("reference", REFERENCE)):
                model.ops = ops
                best[name] = max(best[name], run(llm, batch, out))
        print(f"{a.quantization} batch {batch}: fused {best['fused']:.1f} tok/s, reference ops "
              f"{best['reference']:.1f} tok/s, ratio {best['fused'] / best['reference']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
