"""Offline throughput: our engine vs transformers generate (one at a time, and static batches of 16).

Same 64 requests for every system (fixed seed): prompts of 128-512 random tokens, 32-256 output tokens,
ignore_eos so every system produces exactly the requested lengths. Prints output tokens/s of each, the
ratios, and the KV waste of our engine (allocated slots minus live tokens, over allocated, averaged over
steps weighted by allocation). Run: ``.venv/bin/python bench/offline_throughput.py [--hf-one-requests N]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.core.sampling_params import SamplingParams  # noqa: E402
from workers.llm import LLM  # noqa: E402


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(128, 512), rng.randint(32, 256)
        reqs.append(([rng.randrange(100, vocab) for _ in range(plen)], olen))
    return reqs


def run_engine(llm: LLM, reqs: list[tuple[list[int], int]]) -> tuple[float, int, float]:
    """Returns (seconds, output tokens, KV waste)."""
    eng = llm.engine
    for i, (p, o) in enumerate(reqs):
        eng.add_request(f"b{i}", p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    bm, sched = eng.scheduler.bm, eng.scheduler
    n_out, alloc_sum, live_sum = 0, 0, 0
    t = time.perf_counter()
    while eng.has_unfinished():
        # Measure before the step's finished requests release their blocks.
        outs = eng.step()
        n_out += sum(len(o.new_token_ids) for o in outs)
        alloc = (bm.num_blocks - bm.num_free_blocks) * bm.block_size
        live = sum(r.num_computed_tokens for r in sched.running)
        alloc_sum, live_sum = alloc_sum + alloc, live_sum + live
    dt = time.perf_counter() - t
    return dt, n_out, (alloc_sum - live_sum) / max(alloc_sum, 1)


def run_hf_one(model: torch.nn.Module, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
    t, n = time.perf_counter(), 0
    for p, o in reqs:
        ids = torch.tensor([p])
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=o, min_new_tokens=o,
                           do_sample=False, pad_token_id=0)
        n += o
    return time.perf_counter() - t, n


def run_hf_static(model: torch.nn.Module, reqs: list[tuple[list[int], int]], bs: int) -> tuple[float, int]:
    """Static batches with left padding; a batch runs until its longest request is done, so only the
    requested tokens count as output (the rest is the waste static batching pays)."""
    t, n = time.perf_counter(), 0
    for i in range(0, len(reqs), bs):
        batch = reqs[i:i + bs]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        o = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=o, min_new_tokens=o, do_sample=False,
                           pad_token_id=0)
        n += sum(o for _, o in batch)
    return time.perf_counter() - t, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--hf-one-requests", type=int, default=None,
                    help="run the one-at-a-time baseline on the first N requests only (a rate, so comparable)")
    ap.add_argument("--hf-static-requests", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    llm = LLM(a.model, dtype=a.dtype, max_num_batched_tokens=a.max_num_batched_tokens,
              max_num_seqs=a.max_num_seqs, kv_cache_tokens=65536, enable_prefix_caching=False,
              kv_cache_dtype=a.kv_cache_dtype)
    reqs = workload(a.num_requests, a.seed, llm.engine.vocab_size)
    print(f"workload: {len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
          f"output tokens {sum(o for _, o in reqs)}, torch threads {torch.get_num_threads()}")
    dt, n, waste = run_engine(llm, reqs)
    ours = n / dt
    print(f"kvgate engine       : {n} tokens in {dt:7.1f}s = {ours:7.1f} tok/s   KV waste {100 * waste:.2f}%")
    if a.skip_hf:
        return
    from transformers import AutoModelForCausalLM

    from workers.model_files import resolve

    hf = AutoModelForCausalLM.from_pretrained(resolve(a.model).directory, dtype=getattr(torch, a.dtype)).eval()
    one = reqs[: a.hf_one_requests or len(reqs)]
    dt1, n1 = run_hf_one(hf, one)
    print(f"hf one-at-a-time    : {n1} tokens in {dt1:7.1f}s = {n1 / dt1:7.1f} tok/s   ({len(one)} requests)")
    st = reqs[: a.hf_static_requests or len(reqs)]
    dt2, n2 = run_hf_static(hf, st, 16)
    print(f"hf static batch 16  : {n2} tokens in {dt2:7.1f}s = {n2 / dt2:7.1f} tok/s   ({len(st)} requests)")
    print(f"ratio vs one-at-a-time: {ours / (n1 / dt1):.2f}x   ratio vs static batching: {ours / (n2 / dt2):.2f}x")


if __name__ == "__main__":
    main()
