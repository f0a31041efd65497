"""Spawn and supervise the gateway's local worker subprocesses.

One task per worker slot runs the worker, waits for it to exit, tells the pool (so its requests fail at
once), and restarts it after an exponential backoff (reset once a worker has run for a while), or at once
when the operator drained it (``WorkerPool.drain``): same id, same slot. When the
gateway stops, the slot's task is cancelled and the worker is terminated, then killed; when the gateway is
SIGKILLed, the kernel kills the workers (PR_SET_PDEATHSIG) and they also watch their parent pid themselves.

Processes are forked from the Trio thread on purpose: PR_SET_PDEATHSIG fires when the *thread* that forked
the child exits, and ``trio.lowlevel.open_process`` forks from a short-lived worker thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import trio

from gateway.config import EngineArgs, TimingConfig
from gateway.fleet.pool import WorkerPool

log = logging.getLogger("kvgate.gateway.supervisor")

_PR_SET_PDEATHSIG = 1
HEALTHY_RUN_S = 60.0  # a worker that ran this long resets the backoff: its next crash is not a crash loop
DEFAULT_STARTUP_S = 10.0  # guess of spawn-to-Hello time until one was measured


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the worker's own --parent-pid watch still applies


# Iterations an OpenMP thread spins at a barrier before it sleeps (libgomp's own default when no wait policy
# is set; a few milliseconds on the CPUs we run on). A decode step is ~300 short parallel regions in one C++
# call: sleeping at every barrier (OMP_WAIT_POLICY=PASSIVE) cost 2 ms a step, and spinning forever (ACTIVE)
# keeps a core busy while the worker is idle. Measured through `kvgate serve` on 2 cores (bench/RESULTS.md,
# 2026-11-24): c1 63.9 -> 84.7 tok/s, c16 145.0 -> 151.6 against PASSIVE.
SPIN_COUNT = "300000"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_env(workers: int = 1, threads_per_worker: int | None = None) -> dict[str, str]:
    """The worker's environment: how its OpenMP threads wait at barriers. Bounded spinning (SPIN_COUNT) while
    the local workers' threads fit the CPUs; sleeping waits (PASSIVE) when they do not, since a thread spinning
    for its preempted partner then holds a core another worker needs (threads_per_worker None: torch's
    default, one per core). An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."""
    env = dict(os.environ)
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return env
    cpus = _cpus()
    if workers * (threads_per_worker or cpus) > cpus:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return env


async def wait_process(proc: subprocess.Popen[bytes]) -> int:
    """Wait for a child without blocking Trio (a pidfd where the OS has one, else polling)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while proc.poll() is None:
            await trio.sleep(0.05)
        return proc.returncode
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return proc.wait()


class Supervisor:
    def __init__(self, pool: WorkerPool, count: int, connect: str, model: str | Path, served_model_name: str,
                 engine: EngineArgs, timing: TimingConfig, python: str = sys.executable,
                 on_restart: Callable[[str], None] = lambda worker_id: None, log_format: str = "json",
                 extra_env: Mapping[str, str] | None = None) -> None:
        self._pool = pool
        self._extra_env = dict(extra_env or {})  # e.g. the local workers' CURVE keys (never on argv)
        self._on_restart = on_restart  # counts restarts (metrics); called before each backoff
        self._count = count
        self._env = worker_env(count, engine.num_threads if engine.device == "cpu" else 1)
        self._base_cmd = [python, "-m", "workers.process.worker", "--connect", connect, "--model", str(model),
                          "--served-model-name", served_model_name, "--parent-pid", str(os.getpid()),
                          "--log-format", log_format, *engine.argv()]
        self._timing = timing
        self._next_start: dict[int, float] = {}  # slot -> trio time of its next (re)start
        self._startup_s: float | None = None  # measured spawn-to-Hello time of the last start
        self.pids: dict[str, int] = {}  # worker id -> pid of the running process (for tests and logs)

    def worker_ids(self) -> set[str]:
        return {f"w{slot}" for slot in range(self._count)}

    def command(self, worker_id: str) -> list[str]:
        return [*self._base_cmd, "--worker-id", worker_id]

    def restart_eta(self) -> float | None:
        """Seconds until a local worker is likely to say Hello (None without local workers)."""
        if not self._next_start:
            return None
        now = trio.current_time()
        wait = min(max(0.0, t - now) for t in self._next_start.values())
        return wait + (self._startup_s if self._startup_s is not None else DEFAULT_STARTUP_S)

    def kill(self, worker_id: str, pid: int) -> bool:
        """SIGKILL our worker ``worker_id`` if ``pid`` is its running process (the pool gave up on it: frozen
        or hung). Its slot's task sees the exit and restarts it with the usual backoff. SIGKILL, not SIGTERM:
        a frozen process (SIGSTOP, a native hang) would not act on anything it can catch."""
        if self.pids.get(worker_id) != pid:
            return False  # not ours, or already replaced
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for slot in range(self._count):
                nursery.start_soon(self._supervise, slot)
            task_status.started()

    async def _supervise(self, slot: int) -> None:
        worker_id = f"w{slot}"  # stable across restarts: metrics labels and affinity survive a crash
        failures = 0
        while True:
            started = trio.current_time()
            self._next_start[slot] = started
            rc, pid = await self._run_once(worker_id, started)
            if self._pool.drained(pid):  # the operator drained it: a fresh one now, not a crash's backoff
                log.info("worker %s (pid %d) drained and exited with %s; starting a fresh one", worker_id, pid, rc)
                self._on_restart(worker_id)
                continue
            if trio.current_time() - started >= HEALTHY_RUN_S:
                failures = 0
            delay = min(self._timing.restart_backoff_max, self._timing.restart_backoff_initial * 2 ** failures)
            failures += 1
            log.warning("worker %s exited with %s; restarting in %.1fs", worker_id, rc, delay)
            self._on_restart(worker_id)
            self._next_start[slot] = trio.current_time() + delay
            await trio.sleep(delay)

    async def _run_once(self, worker_id: str, started: float) -> tuple[int, int]:
        # Popen from the Trio thread (see the module docstring); a fork+exec takes milliseconds.
        proc = subprocess.Popen(self.command(worker_id), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                env={**self._env, **self._extra_env})
        self.pids[worker_id] = proc.pid
        log.info("started worker %s (pid %d)", worker_id, proc.pid)
        try:
            rc = await wait_process(proc)
        finally:
            with trio.CancelScope(shield=True):  # never leave a child behind, even when cancelled
                await _stop(proc)
                self.pids.pop(worker_id, None)
                hello_at = self._pool.hello_times.pop(proc.pid, None)
                if hello_at is not None:
                    self._startup_s = hello_at - started
                self._pool.process_exited(worker_id, proc.pid)
        return rc, proc.pid


async def _stop(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    with trio.move_on_after(grace):
        await wait_process(proc)
        return
    proc.kill()
    await wait_process(proc)

