"""N-gram speculative decoding, with and without, through the offline engine (one process, one model).

    .venv/bin/python bench/spec_decode.py [--model smollm2] [--max-tokens 64] [--k 4] [--output-json out.json]

Workloads (greedy, fixed):
- quote: chat prompts whose answers quote their input ("Repeat the following passage exactly", "Copy the
  sentences of the passage that mention X"), over 8 passages;
- random: random token-id prompts of 128 tokens with ignore_eos (bench/serve.py's random workload).
Each at concurrency 1 (requests one after another) and 16 (16 requests at once), in modes: off, on (the
default back-off rule: no drafts above 4 running requests) and, at 16, on-nobackoff (disable_by_batch_size
large, to show what the rule avoids). Modes run interleaved on the same engine, so ratios are taken on the same
machine state; a shared machine makes absolute numbers noisy. Metrics: output tok/s over wall time; ITL as
the gap between a request's consecutive step outputs divided evenly over the tokens that output carried
(per-token latency; a chunk of 3 accepted tokens counts 3 equal gaps); acceptance = accepted / drafted tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import Any

import numpy as np

from workers.core.sampling_params import SamplingParams
from workers.core.spec_decode import SpeculativeConfig
from workers.llm import LLM

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, polished the great "
    "lens, and wrote the weather in a leather logbook that his grandfather had started.",
    "Honeybees communicate the location of flowers through a waggle dance: the angle of the run shows the "
    "direction relative to the sun, and its length shows the distance to the food.",
    "The city council voted to extend the tram line to the harbour, adding four stations, a bicycle bridge over "
    "the canal, and a depot that will be powered by solar panels on its roof.",
    "To make the bread, mix the flour, water, salt and yeast, knead the dough for ten minutes, let it rise for "
    "two hours, shape it into a loaf, and bake it at two hundred and thirty degrees.",
    "Mercury is the smallest planet in the solar system and the closest to the sun; a year there lasts eighty "
    "eight days, while a single day from sunrise to sunrise lasts about one hundred and seventy six.",
    "The library will close for renovation in March; borrowed books can be returned to the branch on Elm Street, "
    "and the reading room will reopen in September with new lighting and longer hours.",
    "In the experiment, the students heated the copper wire, measured its resistance every thirty seconds, and "
    "found that the resistance rose almost linearly with the temperature of the wire.",
    "The old railway station became a market hall: farmers sell cheese and vegetables on the platforms, and the "
    "former ticket office is now a small cafe that serves soup and fresh bread.",
]
TASKS = ["Repeat the following passage exactly, word for word:\n\n{p}",
         "Copy the passage below, keeping every word, and then say how many sentences it has.\n\n{p}"]


def quote_prompts(llm: LLM, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": TASKS[i % 2].format(p=PASSAGES[i % len(PASSAGES)])}] for i in range(n)]
    return [llm.apply_chat_template(c) for c in chats]


def random_prompts(vocab: int, n: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[int, list[float]]:
    """All prompts at once; returns output tokens and per-token ITLs."""
    last: dict[str, float] = {}
    itl: list[float] = []
    tokens = 0
    for i, p in enumerate(prompts):
        # a salt per mode: no mode reuses another's cached prompt blocks (the later ones would skip prefill)
        llm.add_request(f"{tag}-{i}", p, params, cache_salt=tag.rsplit("-", 1)[0])
    while llm.has_unfinished():
        outs = llm.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.new_token_ids)
            tokens += n
            if n and o.request_id in last:
                itl += [(now - last[o.request_id]) / n] * n
            if n:
                last[o.request_id] = now
    return tokens, itl


def measure(llm: LLM, prompts: list[list[int]], conc: int, params: SamplingParams, spec: SpeculativeConfig | None,
            tag: str) -> dict[str, Any]:
    eng = llm.engine
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, speculative=spec)
    eng.reset_counters()
    t0 = time.perf_counter()
    tokens, itl = 0, []
    for start in range(0, len(prompts), conc):
        n, gaps = run_batch(llm, prompts[start:start + conc], params, f"{tag}-{start}")
        tokens += n
        itl += gaps
    wall = time.perf_counter() - t0
    st = eng.stats()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "itl_p50_ms": float(np.percentile(itl, 50)) * 1e3, "itl_p99_ms": float(np.percentile(itl, 99)) * 1e3,
            "drafts": st.spec_num_drafts, "draft_tokens": st.spec_num_draft_tokens,
            "accepted": st.spec_num_accepted_tokens,
            "acceptance": st.spec_num_accepted_tokens / st.spec_num_draft_tokens if st.spec_num_draft_tokens else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--c1-requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, num_threads=a.threads, max_num_batched_tokens=512, kv_cache_tokens=16384)
    on = SpeculativeConfig(num_speculative_tokens=a.k, prompt_lookup_min=1, prompt_lookup_max=3)
    modes = {"off": None, "on": on, "on-nobackoff": dataclasses.replace(on, disable_by_batch_size=10_000)}
    results: list[dict[str, Any]] = []
    for workload in ("quote", "random"):
        ignore_eos = workload == "random"
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        for conc, n in ((1, a.c1_requests), (16, 16)):
            prompts = (quote_prompts(llm, n) if workload == "quote"
                       else random_prompts(llm.engine.vocab_size, n))
            names = ["off", "on"] if conc == 1 else ["off", "on", "on-nobackoff"]
            for name in names:
                r = measure(llm, prompts, conc, params, modes[name], f"{workload}{conc}{name}")
                r.update(workload=workload, concurrency=conc, mode=name)
                results.append(r)
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                print(f"{workload:6s} c{conc:<2d} {name:13s} {r['tok_s']:7.1f} tok/s  ITL p50 {r['itl_p50_ms']:7.1f} "
                      f"ms p99 {r['itl_p99_ms']:7.1f} ms  acceptance {acc} ({r['accepted']}/{r['draft_tokens']}, "
                      f"{r['drafts']} drafts)  {r['tokens']} tokens {r['wall_s']:.1f} s", flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
