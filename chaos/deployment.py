"""A throw-away kvgate deployment for one drill: gateway + local workers + a fresh store, in a temp directory.

Everything binds 127.0.0.1. The gateway runs as ``python -m gateway serve`` with its own admin token and server
secret; the drill's tenant and keys are created through ``/admin`` once it is ready (the same path ``--url`` mode
takes, so both modes provision alike). ``stop`` ends the gateway and then makes sure no worker it started is
left: a drill that SIGKILLs a gateway must not leave workers behind on the machine, whatever the product does.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from chaos import procs

STARTUP_TIMEOUT_S = 300.0  # the first start of smollm2 converts its GGUF (about a minute on 2 cores)


@dataclass(frozen=True)
class DeploymentSpec:
    model: str  # --model: an alias (smollm2), a .gguf or a safetensors directory
    workers: int = 1
    serve_args: tuple[str, ...] = ()  # extra `kvgate serve` flags of the drill
    redis: bool = False  # start a private redis-server and pass --redis-url
    torch_threads: int | None = None  # OMP_NUM_THREADS of the workers (None: torch's default)
    served_name: str = "chaos"
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the gateway (its workers inherit it)
    store_subdir: str = ""  # the store lives in this folder of the deployment's directory (a drill may mount it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    """One gateway process (restartable on the same port, store and secret) and the workers it supervises."""

    def __init__(self, spec: DeploymentSpec, workdir: Path, redis_url: str | None = None) -> None:
        self.spec, self.workdir, self.redis_url = spec, workdir, redis_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = "chaos-admin-" + secrets.token_hex(16)
        self.secret = secrets.token_hex(32)
        self.db_path = workdir / spec.store_subdir / "kvgate.db"
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._seen_workers: set[int] = set()  # every worker pid this deployment ever had: none may outlive it

    def sibling(self, serve_args: tuple[str, ...]) -> Deployment:
        """A second gateway (its own port, log and workers) on this deployment's store, secret, admin token and
        Redis: several gateways behind one load balancer. Not started; the caller starts and stops it."""
        spec = dataclasses.replace(self.spec, serve_args=(*self.spec.serve_args, *serve_args))
        twin = Deployment(spec, self.workdir, self.redis_url)
        twin.admin_token, twin.secret = self.admin_token, self.secret
        twin.log_path = self.workdir / f"gateway-{twin.port}.log"
        return twin

    def command(self) -> list[str]:
        s = self.spec
        cmd = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", s.model, "--served-model-name", s.served_name, "--workers", str(s.workers),
               "--db", str(self.db_path), "--admin-token", self.admin_token, "--no-demo-tenant",
               "--log-level", "INFO", *s.serve_args]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        return cmd

    def env(self) -> dict[str, str]:
        env = {**os.environ, "KVGATE_SECRET": self.secret, "PYTHONUNBUFFERED": "1"}
        if self.spec.torch_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.spec.torch_threads)
        env.update(self.spec.env)
        return env

    @property
    def gateway_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def worker_pids(self) -> list[int]:
        pid = self.gateway_pid
        pids = procs.worker_pids(pid) if pid is not None else []
        self._seen_workers.update(pids)
        return pids

    async def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env())
        self.starts += 1
        await self.wait_ready(timeout)

    async def wait_ready(self, timeout: float) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            with trio.fail_after(timeout):
                while True:
                    if self.proc is None or self.proc.poll() is not None:
                        code = None if self.proc is None else self.proc.returncode
                        raise RuntimeError(f"gateway exited with {code} during start-up:\n{self.log_tail()}")
                    try:
                        if (await client.get(f"{self.url}/ready")).status_code == 200:
                            self.worker_pids()
                            return
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.2)

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> int | None:
        """Signal the gateway process; returns its pid (None when it was not running)."""
        pid = self.gateway_pid
        if pid is None or self.proc is None:
            return None
        self.worker_pids()  # remember them: they must go with it
        self.proc.send_signal(sig)
        return pid

    def reap(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> list[int]:
        """SIGTERM the gateway (SIGKILL after 30 s), then SIGKILL any worker it left; returns the pids it had
        to kill that way (orphans: the product's failure, reported by drills that care)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.worker_pids()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        orphans = [p for p in sorted(self._seen_workers) if procs.alive(p) and procs.is_worker(p)]
        for pid in orphans:
            procs.send(pid, signal.SIGCONT)
            procs.send(pid, signal.SIGKILL)
        return orphans

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_tail(chars=50_000_000)
