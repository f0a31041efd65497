"""Online serving benchmark with vLLM ``bench serve`` definitions, against a kvgate (or any OpenAI) server.

    python bench/serve.py --base-url http://127.0.0.1:8000 --model smollm2 --num-prompts 64 \\
        --max-concurrency 8 --random-input-len 256 --random-output-len 64 [--shared-prefix-len 1024] \\
        [--request-rate 4] [--output-json out.json]
    python bench/serve.py --backend engine --model smollm2 ...   # same workload, engine in-process (no HTTP)

Workload (fixed seed): random token-id prompts of ``--random-input-len`` tokens (each with an optional common
``--shared-prefix-len`` prefix), ``--random-output-len`` tokens each with ``ignore_eos``, sent to
``/v1/completions`` with streaming. Arrivals are Poisson at ``--request-rate`` (inf: all at once), at most
``--max-concurrency`` in flight. Metrics as vLLM defines them:
- TTFT: request sent -> first streamed token; E2E: request sent -> last byte;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token;
- ITL: gaps between consecutive streamed chunks; throughput: requests, output tokens, and input + output
  tokens per second over the benchmark's wall time (first send to last completion).
Only 127.0.0.1/localhost is targeted; every run is bounded by ``--num-prompts`` and ``--max-duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

MAX_PROMPTS = 10_000
LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    expected: int = 0  # max_tokens asked (with ignore_eos, what a server honouring it returns)
    chunks: int = 0  # streamed chunks with text: a count of tokens that does not trust the server's usage
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# Short common words, one token each in most BPE vocabularies: --chat prompts of about the asked length.
_WORDS = ("the of and to in is it that was for on are as with his they at be this from have or by one had not but "
          "what all were when we there can an your which their said if do will each about how up out them then she "
          "many some so these would other into has more her two like him see time could no make than first been its "
          "who now people my made over did down only way find use may water long little very after words called just "
          "where most know get through back much before go good new write our used me man too any day same right look "
          "think also around another came come work three word must because does part even place well such here take "
          "why help put different away again off went old number great tell men say small every found still between "
          "name should home big give air line set own under read last never us left end along while might next sound "
          "below saw something thought both few those always show large often together asked house world going want "
          "school important until form food keep children feet land side without boy once animal life enough took").split()


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    """vLLM's --random-range-ratio: lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)]."""
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(a.seed)
    lo = 100  # skip the lowest ids: special and control tokens in most vocabularies
    prefix = [rng.randrange(lo, vocab) for _ in range(a.shared_prefix_len)]
    lens = _lengths(a.random_input_len, a.random_range_ratio, a.num_prompts, rng)
    return [prefix + [rng.randrange(lo, vocab) for _ in range(n)] for n in lens]


def output_lengths(a: argparse.Namespace) -> list[int]:
    ratio = a.random_range_ratio if a.output_range_ratio is None else a.output_range_ratio
    return _lengths(a.random_output_len, ratio, a.num_prompts, random.Random(a.seed + 1))


def chat_text(prompt: list[int]) -> str:
    """A chat message of about len(prompt) words, drawn from the prompt's ids (so seeded like the ids)."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in prompt)


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.exponential(1.0 / rate, size=n))  # Poisson process (vLLM's burstiness 1)


# ---- HTTP backend -------------------------------------------------------------------------------

async def one_request(client: Any, a: argparse.Namespace, prompt: list[int], max_tokens: int) -> Result:
    # min_tokens as well as ignore_eos: servers without ignore_eos (llama-cpp-python's) honour min_tokens.
    body: dict[str, Any] = {"model": a.model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "min_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                            "seed": a.seed}
    if a.send_n_predict:  # llama-server's own name for the output length
        body["n_predict"] = max_tokens
    if a.chat:
        body["messages"] = [{"role": "user", "content": chat_text(prompt)}]
    else:
        body["prompt"] = prompt
    route = "/v1/chat/completions" if a.chat else "/v1/completions"
    res = Result(False, len(prompt), expected=max_tokens)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", f"{a.base_url}{route}", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"].get("code"))
                    return res
                now = time.perf_counter()
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    res.prompt_len = data["usage"]["prompt_tokens"]  # chat: the template's tokens included
                choice = data["choices"][0] if data.get("choices") else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    res.chunks += 1
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.ttft > 0
        if res.ok and res.output_tokens == 0:  # no usage chunk (llama-cpp-python): one token per chunk
            res.output_tokens = res.chunks
    except Exception as e:  # a benchmark reports failures, it does not stop on them
        res.error = type(e).__name__
    return res


async def run_http(a: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[Result], float]:
    import httpx

    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    # No keep-alive: a fresh loopback connection per request, for every server alike. llama-server closes idle
    # keep-alive connections, and a request sent on one as it closed failed with RemoteProtocolError (2 of 8).
    limits = httpx.Limits(max_connections=a.max_concurrency or len(prompts), max_keepalive_connections=0)
    sem = asyncio.Semaphore(a.max_concurrency or len(prompts))
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(a.max_duration), limits=limits) as client:
        async def limited(p: list[int], n: int) -> Result:
            async with sem:
                return await one_request(client, a, p, n)

        t0 = time.perf_counter()
        tasks = []
        for p, n, gap in zip(prompts, output_lengths(a), arrival_gaps(len(prompts), a.request_rate, a.seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(p, n)))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=a.max_duration)
        return list(results), time.perf_counter() - t0


# ---- in-process engine backend (the same workload without gateway, HTTP or IPC) --------------------

def run_engine(a: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[Result], float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from workers.core.sampling_params import SamplingParams
    from workers.llm import LLM

    llm = LLM(a.model, kv_cache_tokens=a.kv_cache_tokens)
    params = SamplingParams(max_tokens=a.random_output_len, temperature=0.0, ignore_eos=True)
    # (the engine backend runs every request at --random-output-len; the HTTP one draws each length)
    gaps = arrival_gaps(len(prompts), a.request_rate, a.seed)
    arrivals = list(np.cumsum(gaps))
    limit = a.max_concurrency or len(prompts)
    results = [Result(False, len(p)) for p in prompts]
    sent: dict[str, tuple[int, float, float]] = {}  # request id -> (index, send time, last token time)
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or sent:
        now = time.perf_counter() - t0
        while nxt < len(prompts) and len(sent) < limit and arrivals[nxt] <= now:
            llm.engine.add_request(f"b{nxt}", prompts[nxt], params)
            sent[f"b{nxt}"] = (nxt, time.perf_counter(), 0.0)
            nxt += 1
        if not sent:
            time.sleep(min(0.01, max(0.0, arrivals[nxt] - now)))
            continue
        for o in llm.engine.step():
            i, ts, last = sent[o.request_id]
            t = time.perf_counter()
            r = results[i]
            if o.new_token_ids:
                r.output_tokens += len(o.new_token_ids)
                if r.ttft == 0.0:
                    r.ttft = t - ts
                else:
                    r.itl.append(t - last)
                sent[o.request_id] = (i, ts, t)
            if o.finish_reason is not None:
                r.e2e, r.ok = t - ts, True
                del sent[o.request_id]
        if time.perf_counter() - t0 > a.max_duration:
            break
    return results, time.perf_counter() - t0


# ---- report -------------------------------------------------------------------------------------

def summarize(results: list[Result], duration: float, percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "errors": sorted({r.error for r in results if r.error}),
        # ignore_eos honoured: every completed request returned the length it asked for (by usage; chunks beside it)
        "wrong_length_outputs": sum(r.output_tokens != r.expected for r in ok if r.expected),
        "total_chunks": sum(r.chunks for r in ok),
        # prefill speed as a client sees it: prompt tokens over time to first token (queueing included at c > 1)
        "median_prompt_tok_s": float(np.median([r.prompt_len / r.ttft for r in ok if r.ttft > 0] or [0.0])),
    }
    series = {"ttft": [r.ttft for r in ok], "e2el": [r.e2e for r in ok],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl]}
    for name, xs in series.items():
        arr = np.array(xs or [0.0]) * 1000.0  # milliseconds, as vLLM reports them
        summary[f"mean_{name}_ms"] = float(arr.mean())
        summary[f"median_{name}_ms"] = float(np.median(arr))
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return summary


def print_table(s: dict[str, Any], a: argparse.Namespace) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Backend", a.backend), ("Max concurrency", a.max_concurrency or "inf"),
            ("Request rate (req/s)", a.request_rate), ("Successful requests", s["completed"]),
            ("Failed requests", s["failed"]), ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Streamed text chunks", s["total_chunks"]), ("Outputs not of the asked length", s["wrong_length_outputs"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>20}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^60}")
        for key in [k for k in s if k.endswith(f"_{name}_ms")]:
            print(f"{key.replace('_', ' ').replace(' ms', ' (ms)').capitalize():<40}{s[key]:>20.2f}")
    if s["errors"]:
        print(f"errors: {', '.join(s['errors'])}")
    print("=" * 60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["http", "engine"], default="http")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2", help="served model name (http) or model to load (engine)")
    p.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY"), help="default: $KVGATE_API_KEY")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="input and output lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's flag)")
    p.add_argument("--output-range-ratio", type=float, default=None,
                   help="the range ratio of output lengths alone (default: --random-range-ratio)")
    p.add_argument("--send-n-predict", action="store_true", help="also send n_predict = max_tokens (llama-server)")
    p.add_argument("--chat", action="store_true",
                   help="send /v1/chat/completions with a text message of about --random-input-len words")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds; the run is cut off past it")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="engine backend only")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if not 1 <= a.num_prompts <= MAX_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if a.backend == "http" and urlparse(a.base_url).hostname not in LOCAL_HOSTS:
        p.error("--base-url must point at 127.0.0.1 or localhost")
    a.base_url = a.base_url.rstrip("/")
    prompts = make_workload(a, a.vocab_size)
    if a.backend == "http":
        results, duration = asyncio.run(run_http(a, prompts))
    else:
        results, duration = run_engine(a, prompts)
    summary = summarize(results, duration, [float(x) for x in a.metric_percentiles.split(",")])
    print_table(summary, a)
    if a.output_json:
        config = {k: v for k, v in vars(a).items() if k != "api_key"}
        Path(a.output_json).write_text(json.dumps({"config": config, **summary}, indent=2))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
