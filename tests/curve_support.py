"""Helpers for the CURVE worker tests: key sets made with ``kvgate keys``, and ``kvgate worker`` processes that join
a gateway with them (tests/test_curve_workers.py on loopback, tests/test_curve_netns.py across namespaces)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ipc.curve import load_public_key
from tests.test_gateway_support import MAX_MODEL_LEN, MODEL, REPO, Server

WORKER_START_S = 240.0  # a worker loads the tiny model and sizes its steps first; a loaded 2-core box is slow


@dataclass(frozen=True)
class KeySet:
    root: Path
    allowed: Path  # the gateway's --worker-keys: public keys only

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def public(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def public_z85(self, name: str) -> str:
        return load_public_key(self.public(name)).decode()

    def gateway_args(self) -> list[str]:
        return ["--worker-keys", str(self.allowed), "--server-secret-key", str(self.secret("gateway"))]


def kvgate_keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "console.kvgate", "keys", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def make_keys(root: Path, listed: tuple[str, ...], unlisted: tuple[str, ...]) -> KeySet:
    """The gateway's pair and one pair per worker name, all made by ``kvgate keys create``; the listed workers'
    public files are copied into the allowed directory, as an operator would."""
    allowed = root / "allowed-workers"
    allowed.mkdir(parents=True)
    for name in ("gateway", *listed, *unlisted):
        out = kvgate_keys("create", name, "--dir", str(root))
        assert out.returncode == 0, out.stderr
    for name in listed:
        (allowed / f"{name}.key").write_bytes((root / f"{name}.key").read_bytes())
    return KeySet(root, allowed)


def start_worker(connect: str, worker_id: str, model_dir: Path, log_path: Path, keys: KeySet | None, key_name: str,
                 env: dict[str, str], prefix: list[str] | None = None) -> subprocess.Popen[bytes]:
    """``kvgate worker`` joining ``connect`` with ``key_name``'s secret key and the gateway's public key (or plain
    ZeroMQ when ``keys`` is None); ``prefix`` runs it inside something (``ip netns exec NS``)."""
    curve = [] if keys is None else ["--key", str(keys.secret(key_name)), "--server-key", str(keys.public("gateway"))]
    cmd = [*(prefix or []), sys.executable, "-m", "console.kvgate", "worker", "--connect", connect, "--worker-id",
           worker_id, "--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-tokens", "16384", "--log-format", "text", *curve]
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.2)


def worker_ids(server: Server) -> list[str]:
    r = httpx.get(f"{server.url}/admin/workers", headers=server.admin_headers, timeout=10)
    r.raise_for_status()
    return sorted(w["hello"]["worker_id"] for w in r.json()["data"])


def complete(server: Server, max_tokens: int = 5) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)

