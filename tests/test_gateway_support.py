"""Shared fixtures for the gateway tests: a tiny model directory and real ``kvgate serve`` subprocesses.

The fixtures are registered for every module by tests/conftest.py; modules import the helpers, never a fixture
(pytest makes an imported session fixture an instance of its own in the importing module: another model directory,
another server). Everything binds 127.0.0.1 on a free port.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests import ports

if TYPE_CHECKING:
    import openai
    from openai.types import Batch

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
MAX_MODEL_LEN = 4096
# Generous: a slow CPU (Zen 1, 2 cores) under a loaded test run; the kernels are prebuilt by make setup.
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    return ports.free_port()  # below the ephemeral range (tests/ports.py)


ADMIN_TOKEN = "admin-" + "t" * 26
_DEMO_KEY_RE = re.compile(r"export KVGATE_API_KEY=(kvg-\S+)")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    model_dir: Path
    db_path: Path
    secret: str  # KVGATE_SECRET of this deployment: kvgatectl --db needs the same one
    api_key: str = ""  # the demo tenant's key, printed once on the first start

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    @property
    def env(self) -> dict[str, str]:
        """The environment of this gateway's deployment (for kvgatectl and a second gateway on its store)."""
        return deployment_env(self.secret)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        import psutil

        pids = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "workers.process.worker" in " ".join(c.cmdline()):
                    pids.append(c.pid)
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                pass  # exited, not yet reaped by the supervisor: not a running worker
        return pids

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


def deployment_env(secret: str) -> dict[str, str]:
    return {**os.environ, "KVGATE_SECRET": secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def start_server(model_dir: Path, log_path: Path, *extra: str, workers: int = 1, served_name: str = MODEL,
                 db_path: Path | None = None, secret: str | None = None, env: dict[str, str] | None = None,
                 wait: bool = True) -> Server:
    """A ``kvgate serve`` on a free port. A fresh store (the default: beside the log) gets the demo tenant,
    whose printed key becomes ``server.api_key``; pass ``db_path`` and ``secret`` to share a store. ``env``
    adds variables (the workers inherit them); ``wait=False`` returns before it is ready (call
    ``finish_start``), for a test that must start an external worker first."""
    port = free_port()
    db_path = db_path or log_path.with_name("kvgate.db")
    cmd = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_dir), "--served-model-name", served_name, "--workers", str(workers),
           "--db", str(db_path), "--admin-token", ADMIN_TOKEN,
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "16384", "--log-level", "INFO", *extra]
    secret = secret or secrets.token_hex(32)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**deployment_env(secret), **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, model_dir, db_path, secret)
    return finish_start(server) if wait else server


def finish_start(server: Server) -> Server:
    """Wait until ``server`` is ready and read the demo key it printed."""
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    found = _DEMO_KEY_RE.search(server.log())
    server.api_key = found.group(1) if found else ""
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


def _shared_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *extra: str,
                   served_name: str = MODEL, env: dict[str, str] | None = None, workers: int = 1) -> Iterator[Server]:
    srv = start_server(model_dir, tmp_path_factory.mktemp(name) / "gateway.log", *extra, served_name=served_name,
                       env=env, workers=workers)
    try:
        if workers > 1:  # ready means one worker joined: wait for the rest too
            from tests.waiting import wait_until

            wait_until(lambda: httpx.get(f"{srv.url}/admin/workers", headers=srv.admin_headers, timeout=10).json(),
                       lambda body: len(body["data"]) >= workers, within=120, what=f"{workers} workers joined",
                       interval=0.2)
        yield srv
    finally:
        srv.stop()


# The servers below are shared by every module that needs one of exactly that configuration (a process tree per
# configuration per run, not per module). A test that kills, suspends or re-limits what it shares starts its own;
# one that makes tenants on a shared server names them uniquely.

@pytest.fixture(scope="session")
def fp32_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """fp32 linears (greedy output is compared with the fp32 offline engine, or choice by choice); steps held 2 ms
    each (the worker's KVGATE_DEBUG_STEP_DELAY drill hook) so the disconnect tests' long requests outlive the 0.5 s
    stats interval on any machine, however fast its decode steps."""
    yield from _shared_server(tiny_model_dir, tmp_path_factory, "fp32", "--quantization", "none",
                              env={"KVGATE_DEBUG_STEP_DELAY": "0.002"})


@pytest.fixture(scope="session")
def fcfs_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``--scheduling-policy fcfs``: workers that refuse any priority but 0."""
    yield from _shared_server(tiny_model_dir, tmp_path_factory, "fcfs", "--scheduling-policy", "fcfs")


@pytest.fixture(scope="session")
def two_worker_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``--workers 2``, both joined: for tests that only send requests (a test that kills, drains or restarts a
    worker starts a deployment of its own)."""
    yield from _shared_server(tiny_model_dir, tmp_path_factory, "two-workers", workers=2)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default deployment for real: ``kvgate serve --model smollm2`` (loading it takes a while on 2 cores)."""
    from gateway.pipeline.tokenizer import resolve_model_dir

    yield from _shared_server(resolve_model_dir("smollm2"), tmp_path_factory, "smollm2", served_name="smollm2")


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def send_raw(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    """A request written on a plain socket whose answer is never read; closing it is the client hanging up
    (at a moment the test chooses, unlike a client timeout)."""
    url = urlsplit(server.url)
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n{head}\r\n".encode() + data)
    return sock


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


BATCH_FINAL = ("completed", "failed", "cancelled", "expired")


def wait_batch(client: openai.OpenAI, batch_id: str, within: float = 120.0,
               until: tuple[str, ...] = BATCH_FINAL) -> Batch:
    """The batch once its status is one of ``until`` (fails past ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until or time.monotonic() > deadline:
            assert batch.status in until, batch
            return batch
        time.sleep(0.2)
