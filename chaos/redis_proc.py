"""A private, throw-away redis-server for drills that need one: loopback only, no persistence, its own port.

``stop`` kills it (clients then see connection refused, as with a dead Redis); ``start`` brings it back on the same
port, empty, as a restarted Redis without persistence would be.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import trio

START_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.exe, self.directory, self.port = exe, directory, _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.directory)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with trio.fail_after(START_TIMEOUT_S):
            while not await trio.to_thread.run_sync(_answers_ping, self.port):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                await trio.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: an outage, not a shutdown (and a stopped server would not act on SIGTERM)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
