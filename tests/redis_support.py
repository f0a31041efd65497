"""A private redis-server for tests: `RedisServer` and the pytest fixtures `redis_server` and `redis_url`.

Each `RedisServer` is a `redis-server` child process on 127.0.0.1 and a free port, with no persistence
(`--save "" --appendonly no`) and its files in a temporary directory. `start()` waits until it answers PING;
`stop()` kills it (clients then get connection refused, as with a dead Redis); `start()` again brings it back on the
same port, empty; `pause()` / `resume()` SIGSTOP / SIGCONT it (clients then time out, as with a hung Redis).

The fixtures are registered for every test module by tests/conftest.py; a test just names them:

    def test_two_gateways(redis_url: str) -> None:   # module-scoped server, flushed before every test
        ...

    def test_outage(redis_server: RedisServer) -> None:   # the same server; stop()/start() it at will
        redis_server.stop(); ...; redis_server.start()

A test that stops or pauses the shared server must leave it running (the fixture restarts it if not), or build its
own: `with RedisServer(tmp_path) as server: ...`. Without `redis-server` on PATH the fixtures skip, unless the
environment sets KVGATE_REQUIRE_REDIS=1, in which case they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import ports

START_TIMEOUT_S = 10.0


def require_redis_server() -> str:
    """Path of redis-server, or skip (fail with KVGATE_REQUIRE_REDIS=1)."""
    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not on PATH"
        if os.environ.get("KVGATE_REQUIRE_REDIS") == "1":
            pytest.fail(message + " and KVGATE_REQUIRE_REDIS=1", pytrace=False)
        pytest.skip(message)
    return path


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range (tests/ports.py)


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.executable = require_redis_server()
        self.directory = directory
        self.port = port or _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        if self.running:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")
        self._process = subprocess.Popen(
            [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.01)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def pause(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server per test module. Before each test that uses `redis_url`, it is restarted if a test
    left it stopped or paused, and flushed."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the module's redis-server, running and empty."""
    redis_server.resume()
    if not redis_server.running:
        redis_server.start()
    redis_server.flush()
    return redis_server.url
