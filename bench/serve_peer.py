"""kvgate serve against llama.cpp's own C++ llama-server on the same GGUF and workloads, in one invocation.

    bash bench/build_llama_server.sh            # once: /tmp/llama-server-build/bin/llama-server
    .venv/bin/python bench/serve_peer.py [--llama-server PATH] [--llama-python /tmp/llamacpp-venv/bin/python] \\
        [--scale 1.0] [--servers llama-server,kvgate] [--output-json out.json]

The servers run one after the other, never both at once, each on the whole list of workloads (fixed seeds, the
same for both), after a short warm-up; then bench/peer_llamacpp.py's single-stream prompt and decode tok/s
(llama-cpp-python in its own venv, the same llama.cpp version) when --llama-python exists. Workloads, all
streaming chat (bench/serve.py --chat: a message of random common words, the model's chat template), greedy,
``ignore_eos`` (and llama-server's ``n_predict``), every output length checked by usage and by streamed chunks:
- c1 and c16: prompts of 128-256 words, outputs of 64-128 tokens, at concurrency 1 (8 requests) and 16 (32);
- prefix512-c4: a 512-word shared prefix + 32-64 unique words, 32 output tokens, concurrency 4 (16 requests).
llama-server: 16 slots (-np 16), continuous batching (-cb), 2 threads, 1,024 context tokens per slot (16,384 in
all). kvgate: `kvgate serve --model smollm2 --workers 1` with its defaults (``--quantization auto``), checked to
run the GGUF's own 4-bit blocks (its worker logs "linear layers: int4"). Prints a markdown table for
bench/RESULTS.md, with the CPU from lscpu; ratios are kvgate / llama-server from this invocation only.
(llama-cpp-python's own server is not a fair peer: one global lock serves one request at a time, and by default
``interrupt_requests`` ends a streaming answer early as soon as another request waits.)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_servers import Server, cpu_line, start_kvgate, start_llama_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHAT = ["--chat", "--random-input-len", "192", "--random-range-ratio", "0.3333", "--random-output-len", "96"]
PREFIX = ["--chat", "--shared-prefix-len", "512", "--random-input-len", "48", "--random-range-ratio", "0.3333",
          "--random-output-len", "32", "--output-range-ratio", "0"]
# name, concurrency, requests at --scale 1, seed (each workload its own, so no server serves one from another's
# cache), serve.py arguments
WORKLOADS: list[tuple[str, int, int, int, list[str]]] = [
    ("c1", 1, 8, 1, CHAT), ("c16", 16, 32, 16, CHAT), ("prefix512-c4", 4, 16, 512, PREFIX)]
KEYS = ("completed", "failed", "wrong_length_outputs", "total_input_tokens", "total_output_tokens", "total_chunks",
        "duration_s", "output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
        "median_prompt_tok_s", "errors")


def run_serve(srv: Server, args: list[str], tmp: Path, name: str, timeout_s: float) -> dict[str, Any]:
    out = tmp / f"{srv.name}-{name}.json"
    cmd = [sys.executable, str(REPO / "bench/serve.py"), "--base-url", srv.url, "--model", "smollm2",
           "--api-key", srv.key or "none", "--output-json", str(out), "--max-duration", str(timeout_s), *args,
           *srv.serve_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if not out.exists():
        raise RuntimeError(f"bench/serve.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    s = json.loads(out.read_text())
    return {k: s[k] for k in KEYS}


def bench_server(srv: Server, a: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    run_serve(srv, ["--chat", "--num-prompts", "2", "--max-concurrency", "2", "--random-input-len", "32",
                    "--random-output-len", "8", "--seed", "999"], tmp, "warmup", 300)
    rows: dict[str, dict[str, Any]] = {}
    for name, conc, n, seed, args in WORKLOADS:
        if a.workloads and name not in a.workloads.split(","):
            continue
        n = max(1, round(n * a.scale))
        load = os.getloadavg()[0]
        r = run_serve(srv, [*args, "--num-prompts", str(n), "--max-concurrency", str(conc), "--seed", str(seed)],
                      tmp, name, a.max_duration)
        rows[name] = {**r, "concurrency": conc, "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
        print(json.dumps({"server": srv.name, "workload": name, **rows[name]}), flush=True)
    return rows


def single_stream(a: argparse.Namespace) -> str:
    if not Path(a.llama_python).exists():
        return f"(single stream skipped: {a.llama_python} not found)"
    cmd = [sys.executable, str(REPO / "bench/peer_llamacpp.py"), "--llama-python", a.llama_python,
           "--modes", a.single_modes, "--threads", str(a.threads)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc.stdout if proc.returncode == 0 else f"(single stream failed: {proc.stderr[-1500:]})"


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| workload | server | done / failed | out tokens (chunks; wrong length) | output tok/s | TTFT p50 ms "
             "| TPOT p50 ms | prompt tok/s p50 | load before/after |", "|---|---|---|---|---:|---:|---:|---:|---|"]
    for name, *_ in WORKLOADS:
        for server, rows in results.items():
            r = rows.get(name)
            if r is None:
                continue
            lines.append(f"| {name} | {server} | {r['completed']} / {r['failed']} | {r['total_output_tokens']} "
                         f"({r['total_chunks']}; {r['wrong_length_outputs']}) | {fmt(r['output_throughput'])} | "
                         f"{fmt(r['median_ttft_ms'], 0)} | {fmt(r['median_tpot_ms'], 0)} | "
                         f"{fmt(r['median_prompt_tok_s'])} | {r['load_before']} / {r['load_after']} |")
    ours = [s for s in results if s != "llama-server"]
    if "llama-server" in results and ours:
        lines += ["", "| workload | kvgate server | output tok/s kvgate / llama-server | TTFT p50 llama / kvgate "
                  "| TPOT p50 llama / kvgate | prompt tok/s kvgate / llama |", "|---|---|---:|---:|---:|---:|"]
        for name, *_ in WORKLOADS:
            for server in ours:
                k, l = results[server].get(name), results["llama-server"].get(name)
                if k and l:
                    lines.append(f"| {name} | {server} | {ratio(k, l, 'output_throughput')} | "
                                 f"{ratio(l, k, 'median_ttft_ms')} | {ratio(l, k, 'median_tpot_ms')} | "
                                 f"{ratio(k, l, 'median_prompt_tok_s')} |")
    return "\n".join(lines)


def ratio(num: dict[str, Any], den: dict[str, Any], key: str) -> str:
    return f"{num[key] / den[key]:.2f}x" if den[key] else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default="/tmp/llama-server-build/bin/llama-server")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server flags, e.g. '--no-repack' (its AMX weight repacking of ggml 0.3.36's "
                         "vendored llama.cpp crashes on Q4_1 at load, SIGSEGV in ggml_backend_amx_mul_mat, on a Xeon "
                         "with AMX-INT8)")
    ap.add_argument("--llama-python", default="/tmp/llamacpp-venv/bin/python",
                    help="llama-cpp-python's venv for bench/peer_llamacpp.py's single stream (skipped if absent)")
    ap.add_argument("--single-modes", default="none,int4", help="kvgate modes of the single-stream comparison")
    ap.add_argument("--servers", default="llama-server,kvgate",
                    help="in this order: llama-server, kvgate (its defaults) and names given by --kvgate-variant")
    ap.add_argument("--kvgate-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="a kvgate server with more `kvgate serve` flags, e.g. 'kvgate-t2=--num-threads 2' (repeatable)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    ap.add_argument("--workloads", default="", help="comma-separated subset of c1,c16,prefix512-c4 (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-duration", type=float, default=600.0, help="seconds per workload")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--log-dir", default="/tmp/kvgate-serve-peer", help="servers' logs, kept after the run")
    a = ap.parse_args()
    variants = {"kvgate": ""} | dict(v.split("=", 1) for v in a.kvgate_variant)
    unknown = [n for n in a.servers.split(",") if n != "llama-server" and n not in variants]
    if unknown:
        ap.error(f"--servers: {unknown} are neither llama-server, kvgate nor a --kvgate-variant")
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(cpu_line(), flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in a.servers.split(","):
            own = tmp / name  # each kvgate its own store: a fresh one prints the demo key the bench uses
            own.mkdir()
            start = (start_llama_server(a, own) if name == "llama-server"
                     else start_kvgate(a, own, shlex.split(variants[name])))
            with start as srv:
                notes += srv.notes
                results[name] = bench_server(srv, a, tmp)
    single = single_stream(a) if a.llama_python else ""
    minutes = (time.monotonic() - t0) / 60
    report = "\n".join([f"CPU: {cpu_line()}", *[f"- {n}" for n in notes], "", table(results), "",
                        "Single stream (bench/peer_llamacpp.py):", "", single.strip(), "",
                        f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}` ({minutes:.1f} minutes)"])
    print(report)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"cpu": cpu_line(), "notes": notes, "results": results,
                                                   "single_stream": single, "minutes": minutes}, indent=2))
    bad = [f"{s}/{w}" for s, rows in results.items() for w, r in rows.items()
           if r["failed"] or r["wrong_length_outputs"]]
    if bad:
        print(f"INVALID: failures or outputs of the wrong length in {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
