"""Per-step cost of structured-output masking inside the engine, smollm2 on this CPU, at concurrency 1 and 16.

Runs the same chat requests (temperature 0.7, seeded) through one engine twice per concurrency: with a JSON
schema (bench/structured_engines.py's moderate schema) and unconstrained; times the grammar work per step (mask
fill + apply + matcher advance, measured around ``StructuredOutputs.mask``/``advance``) against the whole step.

    .venv/bin/python bench/structured_step.py [--max-tokens 64] [--quantization auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.structured_engines import SCHEMA, cpu_name  # noqa: E402


def _timed_method(obj: Any, name: str, sink: list[float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run(engine: Any, prompt: list[int], n: int, max_tokens: int, spec: str | None) -> dict[str, float]:
    from workers.core.sampling_params import SamplingParams

    grammar_s: list[float] = []
    outputs = engine.structured
    saved = outputs.mask, outputs.advance
    _timed_method(outputs, "mask", grammar_s)
    _timed_method(outputs, "advance", grammar_s)
    for i in range(n):
        engine.add_request(f"r{i}-{spec is None}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.7, seed=i, structured=spec))
    steps: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps.append(time.perf_counter() - t0)
    outputs.mask, outputs.advance = saved
    decode = steps[1:]  # the first step is the prefill
    per_step_grammar = sum(grammar_s[2:]) / max(1, len(decode))  # mask + advance of the prefill step dropped
    return {"steps": len(steps), "tokens": tokens, "step_ms_mean": statistics.fmean(decode) * 1e3,
            "grammar_ms_per_step": per_step_grammar * 1e3,
            "grammar_share_pct": 100 * per_step_grammar / statistics.fmean(decode)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    from workers.config import EngineConfig, ModelConfig
    from workers.engine_build import engine_from_config

    engine, directory = engine_from_config(EngineConfig(ModelConfig("smollm2", quantization=args.quantization)))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a fictional person as JSON."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    spec = json.dumps({"type": "json_schema", "schema": SCHEMA})
    print(f"CPU: {cpu_name()}; smollm2 quantization {args.quantization}; max_tokens {args.max_tokens}")
    for n in (1, 16):
        for label, s in (("json_schema", spec), ("unconstrained", None)):
            r = run(engine, prompt, n, args.max_tokens, s)
            print(json.dumps({"concurrency": n, "mode": label} | {k: round(v, 2) for k, v in r.items()}))


if __name__ == "__main__":
    main()
