"""Grammar compiles in daemon threads for ``workers.structured``: the shared compile record, the bounded pool
that starts them, and how a finished one reads (a matcher template or a refusal). All bookkeeping runs on the
engine thread (``submit``, ``pump``); a compile thread only builds and sets its future."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

log = logging.getLogger("workers.structured")

# Threads a compile past its bound may keep beyond COMPILE_THREADS: once COMPILE_THREADS + MAX_OVERDUE threads
# run, no new compile starts (a flood of pathological schemas cannot take every core)
MAX_OVERDUE = 2

class StructuredError(ValueError):
    """A grammar spec the engine cannot serve (bad JSON, an unsupported schema feature, too slow to compile)."""


@dataclass(eq=False)
class Compile:
    """One grammar compile, shared by every request whose spec has the same canonical JSON. Its future holds
    the compiled matcher (a template: never advanced, only copied) or the StructuredError refusing it."""

    key: str
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    started: float | None = None  # when a thread took it; None while queued
    overdue: bool = False  # ran past the bound: its thread no longer counts against COMPILE_THREADS
    waiters: int = 0  # parked requests (and blocking callers) that want it

    def want(self) -> None:
        self.waiters += 1

    def unwant(self) -> bool:
        """One who wanted it no longer does; True when nobody does now."""
        self.waiters -= 1
        return self.waiters == 0


@dataclass(eq=False)
class Waiter:
    compile: Compile
    added: float  # when the request was parked (the compile bound counts from here, see _deadline)


def settle(future: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    """In a helper thread: ``fn``'s result or exception into ``future``."""
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001  whatever it was, whoever waits on the future must hear of it
        if not isinstance(e, StructuredError):  # the exception, never the schema: that is user content
            log.error("%s failed", threading.current_thread().name, exc_info=e)
        future.set_exception(e)
    else:
        future.set_result(result)


def in_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future[Any]:
    """``fn`` in a daemon thread: one that never ends must not keep the worker from exiting."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    threading.Thread(target=settle, args=(future, fn), name=name, daemon=True).start()
    return future


class Compiler:
    """Runs compiles in daemon threads. All bookkeeping happens on the engine thread (``submit``, ``pump``); a
    thread only builds and sets the future."""

    def __init__(self, build: Callable[[str], Any], threads: int, bound_s: float,
                 clock: Callable[[], float]) -> None:
        self.build, self.threads, self.bound_s, self.clock = build, threads, bound_s, clock
        self._queue: deque[Compile] = deque()
        self._running: list[Compile] = []

    def submit(self, job: Compile) -> None:
        self._queue.append(job)  # started by the next pump

    def pump(self) -> None:
        """Forget finished compiles, mark those past the bound overdue, start queued ones in the free slots."""
        now = self.clock()
        self._running = [j for j in self._running if not j.future.done()]
        for j in self._running:
            if not j.overdue and j.started is not None and now - j.started > self.bound_s:
                j.overdue = True  # its thread runs on; a fresh one takes its slot
                log.warning("a grammar compile has run past its bound (%.1f s); a new compile thread takes its "
                            "place", self.bound_s, extra={"fields": {"event": "compile_overdue"}})
        healthy = sum(not j.overdue for j in self._running)
        while self._queue and healthy < self.threads and len(self._running) < self.threads + MAX_OVERDUE:
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue  # every request that wanted it left before it started
            job.started = now
            self._running.append(job)
            healthy += 1
            threading.Thread(target=settle, args=(job.future, partial(self.build, job.key)),
                             name="grammar-compile", daemon=True).start()


def refusal(future: concurrent.futures.Future[Any]) -> tuple[str, str] | None:
    """None when the compile succeeded, else (error code, why) its requests are refused (the future is done):
    the schema's fault is "invalid_request" (a 400), a crash of ours "internal_error" (a 500)."""
    exc = future.exception()
    if exc is None:
        return None
    if isinstance(exc, StructuredError):
        return "invalid_request", str(exc)
    return "internal_error", f"the grammar could not be compiled ({type(exc).__name__}); this is a server error"


def failed_internally(job: Compile) -> bool:
    """A compile that crashed (not a StructuredError) is not cached: the next request tries again."""
    f = job.future
    return f.done() and not f.cancelled() and f.exception() is not None \
        and not isinstance(f.exception(), StructuredError)
