"""The processes of a deployment on this host: who they are, whether they live, how much memory they hold.

Drills signal processes (SIGKILL, SIGSTOP), so they must know exactly which ones: a spawned deployment knows its
gateway's pid; for ``--url`` the gateway is the process listening on that loopback port, and its workers are its
children whose command line runs ``workers.process.worker``. Nothing here matches processes by name across the system.
"""

from __future__ import annotations

import os
import signal
import subprocess
from urllib.parse import urlsplit

import psutil
import trio

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
WORKER_MARK = "workers.process.worker"


def is_loopback_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and (parts.hostname or "") in LOOPBACK_HOSTS


def listening_pid(url: str) -> int | None:
    """The pid of the process listening on ``url``'s loopback port (None when not found or not visible)."""
    port = urlsplit(url).port or (443 if url.startswith("https") else 80)
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a process this code started, then kill it if it has not gone in 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def worker_pids(gateway_pid: int) -> list[int]:
    try:
        children = psutil.Process(gateway_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for c in children:
        try:
            if WORKER_MARK in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(out)


def is_worker(pid: int) -> bool:
    """Still a kvgate worker (a pid we saw may have been reused by the time we look again)."""
    try:
        return WORKER_MARK in " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def rss_bytes(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess:
        return 0


def send(pid: int, sig: signal.Signals) -> bool:
    """Signal one process we know by pid; False when it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


async def wait_gone(pids: list[int], within: float) -> list[int]:
    """Poll until none of ``pids`` lives or ``within`` passes; returns the ones still alive."""
    with trio.move_on_after(within):
        while any(alive(p) for p in pids):
            await trio.sleep(0.05)
    return [p for p in pids if alive(p)]


class RssWatch:
    """Samples the RSS of a set of processes every ``interval`` s and keeps each one's peak; run it in a nursery
    for the length of the load and cancel it after."""

    def __init__(self, pids: dict[str, int], interval: float = 0.2) -> None:
        self.pids = pids
        self.interval = interval
        self.baseline = {name: rss_bytes(pid) for name, pid in pids.items()}
        self.peak = dict(self.baseline)

    async def run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_bytes(pid))
            await trio.sleep(self.interval)

    def growth_mib(self, name: str) -> float:
        return (self.peak[name] - self.baseline[name]) / 2**20
