"""Shared fixtures for the gateway tests: a tiny model directory and real ``kvgate serve`` subprocesses.

Imported by the other ``test_gateway_*`` modules (pytest shares a session fixture across modules when they
import the same function). Everything binds 127.0.0.1 on a free port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 4096
STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    model_dir: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
                if "workers.worker" in " ".join(c.cmdline())]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(model_dir: Path, log_path: Path, *extra: str, workers: int = 1, served_name: str = MODEL) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), "--served-model-name", served_name, "--workers", str(workers),
           "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "16384",
           "--log-level", "INFO", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, model_dir)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_model_dir import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("gateway") / "gateway.log")
    yield srv
    pids = srv.worker_pids()
    srv.stop()
    assert not [p for p in pids if alive(p)], "a clean shutdown must stop every worker"


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metrics(server: Server) -> tuple[float, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return metric_sum(text, "vllm:num_requests_running"), metric_sum(text, "vllm:kv_cache_usage_perc")


def wait_idle(server: Server, within: float = 1.0) -> float:
    """Seconds until the worker reports no running request and an empty KV cache (fails past ``within``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        running, kv = metrics(server)
        if running == 0 and kv == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"worker still busy {within}s later: running={running} kv={kv}")
