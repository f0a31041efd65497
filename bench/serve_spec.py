"""N-gram speculative decoding with and without, through `kvgate serve` (issue 16 item 1's bench).

    .venv/bin/python bench/serve_spec.py [--rounds 2] [--scale 1.0] [--k 4] [--max-tokens 64] \\
        [--quantization none] [--modes off,on,on-nobackoff] [--output-json out.json]

One `kvgate serve --model smollm2 --workers 1` per mode, one server at a time (bench/peer_servers.py's flags):
"off"; "on" (`--speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
"prompt_lookup_max": 3}'`, default back-off: no drafts while more than 4 requests run, none for a request whose
acceptance EMA is below 0.3); "on-nobackoff" (disable_by_batch_size 10000). All get --max-num-batched-tokens 256:
a worker left to size its own budget measures it at start-up, under the machine's load, which changes prefill
chunking between servers. The servers start in turn --rounds times (off, on, off, on, ...); the table gives the
median of the rounds and each round's tok/s ratio against the same round's off. Workloads, fixed seeds:
- quote: streaming chat, bench/spec_decode.py's PASSAGES x TASKS (repeat/copy the passage), greedy, max_tokens
  --max-tokens, ending at EOS (no ignore_eos); a unique first line per prompt, so none reuses another's cache;
- random: streaming /v1/completions, bench/serve.py's random workload (128 token ids), greedy, ignore_eos;
at concurrency 1 (8 requests) and 16 (32), times --scale. Requests ask for logprobs (the sampled token only) so
each SSE chunk says how many tokens it carries: the gateway sends one chunk per worker step output, and with
speculation a step output carries all accepted tokens plus the model's own. ITL is per token: the gap between a
request's consecutive chunks divided evenly over the chunk's tokens (as bench/spec_decode.py). Acceptance: the
gateway's /metrics spec_decode counters before and after each workload (read once the worker's 0.5 s Stats
heartbeat has settled): accepted / drafted tokens, accepted tokens per draft.
Exit status 1 if a request failed or any greedy output differs from off's of the same round (later rounds' off
against round 1's is listed as a control: drift without speculation). With int4 weights activations are
quantized per 32-value block, which can flip near-ties between attention paths (bench/RESULTS.md);
--quantization none checks the algorithm itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_servers import cpu_line, start_kvgate  # noqa: E402
from serve import make_workload  # noqa: E402

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SAMPLE_RE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')
POS_RE = re.compile(r'position="(\d+)"')
WORKLOADS = (("quote", 1, 8), ("quote", 16, 32), ("random", 1, 8), ("random", 16, 32))


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    tokens: list[str] = field(default_factory=list)  # the sampled tokens' text, from logprobs
    text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)


def per_token_gaps(events: list[tuple[float, int]]) -> list[float]:
    """(arrival time, tokens carried) of one request's chunks with tokens -> one latency per token after the
    first chunk: a chunk of n tokens that came g seconds after the previous one counts n gaps of g / n."""
    gaps: list[float] = []
    for (t_prev, _), (t, n) in zip(events, events[1:]):
        gaps += [(t - t_prev) / n] * n
    return gaps


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> each SPEC_COUNTERS metric summed over its series, and ``pos<i>`` for the accepted
    tokens at draft position i (summed over workers)."""
    out: dict[str, float] = {name: 0.0 for name in SPEC_COUNTERS}
    for line in text.splitlines():
        m = SAMPLE_RE.match(line.strip())
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in out:
            out[name] += value
        elif name == PER_POS and (pos := POS_RE.search(labels)):
            out[f"pos{pos.group(1)}"] = out.get(f"pos{pos.group(1)}", 0.0) + value
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts, drafted = d["vllm:spec_decode_num_drafts_total"], d["vllm:spec_decode_num_draft_tokens_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [d[k] / drafts if drafts else 0.0 for k in sorted((k for k in d if k.startswith("pos")),
                                                                 key=lambda k: int(k[3:]))]
    return {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted": int(accepted),
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_draft": accepted / drafts if drafts else None,
            "accepted_rate_per_pos": per_pos, "generation_tokens": int(d["vllm:generation_tokens_total"])}


async def scrape_settled(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """/metrics once two reads 0.7 s apart agree (the worker's Stats heartbeat comes every 0.5 s)."""
    last: dict[str, float] | None = None
    for _ in range(20):
        now = parse_counters((await client.get(f"{url}/metrics", timeout=10)).text)
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.7)
    return last or {}


def request_body(workload: str, conc: int, i: int, a: argparse.Namespace, random_ids: list[list[int]]
                 ) -> tuple[str, dict[str, Any]]:
    common = {"model": "smollm2", "max_tokens": a.max_tokens, "temperature": 0.0, "stream": True, "seed": 0}
    if workload == "quote":
        from spec_decode import PASSAGES, TASKS  # late: it imports torch, which this client needs nowhere else
        task = TASKS[i % len(TASKS)].format(p=PASSAGES[(i // len(TASKS)) % len(PASSAGES)])
        msg = f"Request {conc}-{i}.\n{task}"  # a unique first line: no cached prompt blocks across requests
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": msg}], "logprobs": True}
    return "/v1/completions", {**common, "prompt": random_ids[i], "ignore_eos": True, "logprobs": 0}


def chunk_tokens(choice: dict[str, Any]) -> tuple[list[str], str]:
    lp = choice.get("logprobs") or {}
    toks = [c["token"] for c in lp["content"]] if "content" in lp else list(lp.get("tokens") or [])
    return toks, choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def sse_chunks(r: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed response up to ``[DONE]``; an error event raises RuntimeError."""
    async for line in r.aiter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(json.dumps(chunk["error"])[:300])
            yield chunk


async def one_request(client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any]) -> Result:
    res, events, finished = Result(), [], False
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for data in sse_chunks(r):
                choice = data["choices"][0] if data.get("choices") else {}
                toks, text = chunk_tokens(choice)
                res.text += text
                finished = finished or bool(choice.get("finish_reason"))
                if toks:
                    events.append((time.perf_counter(), len(toks)))
                    res.tokens += toks
                    res.chunk_sizes.append(len(toks))
        res.ok = bool(events) and finished
        res.error = "" if res.ok else "the stream ended without a token or a finish_reason"
        res.ttft = events[0][0] - t0 if events else 0.0
        res.itl = per_token_gaps(events)
    except (httpx.HTTPError, ValueError, KeyError, RuntimeError) as e:  # reported as a failure, not fatal
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


async def run_workload(url: str, key: str, workload: str, conc: int, n: int, a: argparse.Namespace
                       ) -> tuple[dict[str, Any], list[Result]]:
    ns = argparse.Namespace(seed=conc, shared_prefix_len=0, random_input_len=128, random_range_ratio=0.0,
                            num_prompts=n)
    random_ids = make_workload(ns, 49152) if workload == "random" else []
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc + 2)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                 timeout=httpx.Timeout(a.max_duration)) as client:
        async def limited(i: int) -> Result:
            async with sem:
                return await one_request(client, url, *request_body(workload, conc, i, a, random_ids))

        before = await scrape_settled(client, url)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(n)))
        wall = time.perf_counter() - t0
        after = await scrape_settled(client, url)
    return summarize(list(results), wall, before, after, load), list(results)


def summarize(results: list[Result], wall: float, before: dict[str, float], after: dict[str, float],
              load: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itl = np.array([x for r in ok for x in r.itl] or [0.0]) * 1e3
    tokens = sum(len(r.tokens) for r in ok)
    return {"done": len(ok), "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error}),
            "output_tokens": tokens, "chunks": sum(len(r.chunk_sizes) for r in ok), "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50_ms": float(np.median([r.ttft for r in ok] or [0.0])) * 1e3,
            "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2), **acceptance(before, after)}


def mismatches(off: list[Result], on: list[Result]) -> list[str]:
    """Requests whose greedy tokens differ with and without speculation: index, first differing token, lengths."""
    out = []
    for i, (x, y) in enumerate(zip(off, on)):
        if x.ok and y.ok and x.tokens != y.tokens:
            at = next((j for j, (p, q) in enumerate(zip(x.tokens, y.tokens)) if p != q),
                      min(len(x.tokens), len(y.tokens)))
            out.append(f"#{i}: token {at} ({len(x.tokens)} vs {len(y.tokens)} tokens)")
    return out


def bench_mode(mode: str, tag: str, extra: list[str], a: argparse.Namespace, tmp: Path
               ) -> tuple[dict[str, dict[str, Any]], dict[str, list[Result]], str]:
    """One server (its own database and log under ``tag``), warmed up, through every workload."""
    (tmp / tag).mkdir()
    log_dir = Path(a.log_dir) / tag
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[Result]] = {}
    with start_kvgate(argparse.Namespace(log_dir=str(log_dir)), tmp / tag, extra) as srv:
        cmd = ["kvgate", "serve", "--model", "smollm2", "--workers", "1", "--heartbeat-timeout", "60",
               "--drain-timeout", "5", "--log-format", "text", *extra]
        note = f"{mode}: `{shlex.join(cmd)}` (+ --host/--port/--db); {srv.notes[0].split('; ', 1)[1]}"
        warm = argparse.Namespace(**{**vars(a), "max_tokens": 8})
        asyncio.run(run_workload(srv.url, srv.key, "quote", 2, 2, warm))  # first requests pay one-off costs
        for workload, conc, n in WORKLOADS:
            name = f"{workload}-c{conc}"
            rows[name], outputs[name] = asyncio.run(run_workload(srv.url, srv.key, workload, conc,
                                                                 max(1, round(n * a.scale)), a))
            print(json.dumps({"mode": mode, "workload": name, **rows[name]}), flush=True)
    return rows, outputs, note


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mode, workload)'s rounds: counts summed, speed and latency the median of the rounds."""
    counts = ("done", "failed", "output_tokens", "chunks", "drafts", "draft_tokens", "accepted")
    m: dict[str, Any] = {k: sum(r[k] for r in rounds) for k in counts}
    for k in ("tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"):
        m[k] = float(np.median([r[k] for r in rounds]))
    m["tok_s_rounds"] = [r["tok_s"] for r in rounds]
    m["errors"] = sorted({e for r in rounds for e in r["errors"]})
    m["acceptance"] = m["accepted"] / m["draft_tokens"] if m["draft_tokens"] else None
    m["accepted_per_draft"] = m["accepted"] / m["drafts"] if m["drafts"] else None
    return m


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def ratios(r: dict[str, Any], off: dict[str, Any]) -> str:
    """tok/s mode / off per round (same round), their median first."""
    per = [x / y for x, y in zip(r["tok_s_rounds"], off["tok_s_rounds"]) if y]
    return f"{np.median(per):.2f}" + (f" ({', '.join(f'{x:.2f}' for x in per)})" if len(per) > 1 else "")


def table(rows: dict[str, dict[str, dict[str, Any]]], diffs: dict[str, list[str]]) -> str:
    lines = ["| workload | conc | mode | done / failed | out tokens (chunks) | out tok/s | TTFT p50 ms | ITL p50 ms "
             "| ITL p99 ms | acceptance (accepted/drafted) | accepted per draft | tok/s vs off (per round) "
             "| ITL p50 vs off | greedy diffs vs off |",
             "|---|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for workload, conc, _ in WORKLOADS:
        name = f"{workload}-c{conc}"
        for mode in rows:
            r, off = rows[mode][name], rows["off"][name]
            acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f} ({r['accepted']}/{r['draft_tokens']})"
            itl_ratio = f"{r['itl_p50_ms'] / off['itl_p50_ms']:.2f}" if off["itl_p50_ms"] else "–"
            n_diff = len(diffs.get(f"{mode} {name}", []))
            # off's own row: later rounds' off against round 1's (a control: drift without speculation)
            control = f"control: {n_diff}" if f"off {name}" in diffs else ""
            diff = f"{n_diff} of {r['done']}" if mode != "off" else control
            lines.append(f"| {workload} | {conc} | {mode} | {r['done']} / {r['failed']} | {r['output_tokens']} "
                         f"({r['chunks']}) | {fmt(r['tok_s'])} | {fmt(r['ttft_p50_ms'], 0)} | {fmt(r['itl_p50_ms'])} "
                         f"| {fmt(r['itl_p99_ms'])} | {acc} | {fmt(r['accepted_per_draft'], 2)} | {ratios(r, off)} "
                         f"| {itl_ratio} | {diff} |")
    return "\n".join(lines)


def all_diffs(outputs: dict[str, list[dict[str, list[Result]]]]) -> dict[str, list[str]]:
    """'<mode> <workload>' -> differing requests against off of the same round; 'off <workload>': later rounds'
    off against round 1's (the control)."""
    diffs: dict[str, list[str]] = {}
    for mode, rounds in outputs.items():
        for rnd, outs in enumerate(rounds):
            ref = outputs["off"][0 if mode == "off" else rnd]
            if mode == "off" and rnd == 0:
                continue
            for name, res in outs.items():
                diffs.setdefault(f"{mode} {name}", []).extend(f"r{rnd + 1} {d}" for d in mismatches(ref[name], res))
    return diffs


def run_all(a: argparse.Namespace, modes: dict[str, list[str]]
            ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, list[dict[str, list[Result]]]], list[str]]:
    per_round: dict[str, list[dict[str, dict[str, Any]]]] = {m: [] for m in modes}
    outputs: dict[str, list[dict[str, list[Result]]]] = {m: [] for m in modes}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(a.rounds):
            for mode, extra in modes.items():  # modes alternate, so each round's ratios share the machine's state
                rows, outs, note = bench_mode(mode, f"{mode}-r{rnd + 1}", extra, a, Path(d))
                per_round[mode].append(rows)
                outputs[mode].append(outs)
                notes += [note] if rnd == 0 else []
    merged = {m: {name: merge([r[name] for r in rs]) for name in rs[0]} for m, rs in per_round.items()}
    return merged, outputs, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    ap.add_argument("--rounds", type=int, default=2, help="off, on, ... servers started this many times in turn")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=1)
    ap.add_argument("--lookup-max", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", default="off,on", help="off,on[,on-nobackoff] (on with disable_by_batch_size 10000, "
                    "to show what the batch back-off avoids)")
    ap.add_argument("--quantization", default=None, choices=["auto", "none", "int8", "int4", "int8-a8", "int4-a8"],
                    help="passed to every server (default: the server's own, int4 blocks of the GGUF)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="the same step budget for every server (0: each worker measures its own at start-up, "
                         "which varies with the machine's load and changes prefill chunking between servers)")
    ap.add_argument("--max-duration", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--log-dir", default="/tmp/kvgate-serve-spec", help="servers' logs, kept after the run")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    base = (["--quantization", a.quantization] if a.quantization else []) + (
        ["--max-num-batched-tokens", str(a.max_num_batched_tokens)] if a.max_num_batched_tokens else [])
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": a.lookup_min,
            "prompt_lookup_max": a.lookup_max}
    known = {"off": base, "on": [*base, "--speculative-config", json.dumps(spec)],
             "on-nobackoff": [*base, "--speculative-config", json.dumps({**spec, "disable_by_batch_size": 10_000})]}
    if not {"off", "on"} <= set(a.modes.split(",")) <= set(known) or a.rounds < 1:
        ap.error(f"--modes: off, on and optionally on-nobackoff, got {a.modes!r}; --rounds >= 1")
    t0 = time.monotonic()
    print(f"CPU: {cpu_line()}", flush=True)
    rows, outputs, notes = run_all(a, {m: known[m] for m in a.modes.split(",")})
    diffs = all_diffs(outputs)
    spec_diffs = {k: v for k, v in diffs.items() if v and not k.startswith("off ")}
    failed = sum(r["failed"] for m in rows.values() for r in m.values())
    minutes = (time.monotonic() - t0) / 60
    report = "\n".join([f"CPU: {cpu_line()}", *[f"- {n}" for n in notes], "", table(rows, diffs), "",
                        *[f"- greedy diffs {name}: {', '.join(ds)}" for name, ds in diffs.items() if ds],
                        f"Command: `{shlex.join(['.venv/bin/python', *sys.argv])}` ({minutes:.1f} minutes)"])
    print(report)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(
            {"cpu": cpu_line(), "notes": notes, "rows": rows, "greedy_diffs": diffs, "minutes": minutes,
             "outputs": {m: [{w: [asdict(r) for r in rs] for w, rs in o.items()} for o in rounds]
                         for m, rounds in outputs.items()}}, indent=1))
    if failed or spec_diffs:
        errors = sorted({e for m in rows.values() for r in m.values() for e in r["errors"]})
        print(f"FAILED: {failed} failed requests {errors}; greedy diffs against off in {sorted(spec_diffs)}",
              file=sys.stderr)
    return 1 if failed or spec_diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
