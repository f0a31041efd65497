"""The gateway's view of its workers: who is alive, what runs where, and the one ROUTER socket to them.

``WorkerPool`` is the single owner of the worker table, the in-flight request table and the socket. Its tasks
(started with ``nursery.start(pool.run)``): one receiver (the only reader of the socket) dispatching worker
messages to request handles, one monitor declaring silent workers dead, one aborter batching Abort frames.
Route handlers call ``submit`` (async: sends Generate) and ``release`` (sync: safe in any ``finally``).

A worker is alive from its Hello until its process exits (told by the supervisor), it says Goodbye, it misses
heartbeats for ``heartbeat_timeout`` or a send to it fails; then every request on it fails at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable

import trio

from gateway.config import AdmissionConfig, TimingConfig
from gateway.errors import unavailable
from gateway.handle import RequestFailed, RequestHandle
from gateway.routing import Router, prefix_keys
from gateway.worker_state import NoObserver, PoolObserver, WorkerState
from ipc.messages import (Abort, GatewayToWorker, Generate, Goodbye, Hello, RequestError, SamplingValue,
                          Shutdown, Stats, StepOutputs, WorkerToGateway)
from ipc.transport import PeerUnreachable, TrioZmqSocket, router_recv, router_send

log = logging.getLogger("kvgate.gateway.pool")

MONITOR_INTERVAL_S = 0.25
_EWMA_ALPHA = 0.2  # weight of the newest request duration in the service-time average


class WorkerPool:
    def __init__(self, sock: TrioZmqSocket, model_name: str, timing: TimingConfig, admission: AdmissionConfig,
                 restart_eta: Callable[[], float | None] = lambda: None,
                 observer: PoolObserver | None = None) -> None:
        self._sock = sock
        self.model_name = model_name
        self.timing = timing
        self.router = Router(admission)
        self._restart_eta = restart_eta  # the supervisor's estimate of when a worker comes (back) up
        self._send_lock = trio.StrictFIFOLock()  # TrioZmqSocket allows one sender at a time
        self.workers: dict[str, WorkerState] = {}
        self._requests: dict[str, RequestHandle] = {}
        self._aborts: defaultdict[str, set[str]] = defaultdict(set)  # worker id -> request ids to abort
        self._abort_wakeup = trio.Event()
        self._known_hellos: dict[str, Hello] = {}  # last Hello per worker id: lets a worker we gave up on rejoin
        self._exited_pids: set[int] = set()  # local workers whose process is gone: never revive those
        self._refused: set[str] = set()  # worker ids already warned about (wrong model)
        self.hello_times: dict[int, float] = {}  # pid -> trio time of its first Hello (the supervisor pops it)
        self.observer: PoolObserver = observer or NoObserver()
        self._retired_worker_seconds = 0.0  # live time of workers that are gone

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._monitor_loop)
            nursery.start_soon(self._abort_loop)
            task_status.started()

    async def shutdown_workers(self, worker_ids: set[str]) -> None:
        """Best effort: tell these workers to exit now (running requests are dropped). Workers started by
        hand are left alone: they outlive a gateway restart and re-introduce themselves to the next one."""
        with trio.move_on_after(1.0):
            for w in [w for w in self.workers.values() if w.worker_id in worker_ids]:
                try:
                    await self._send_raw(w, Shutdown())
                except (PeerUnreachable, trio.TooSlowError, trio.ClosedResourceError):
                    pass

    # ---- queries --------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.workers)

    @property
    def max_model_len(self) -> int | None:
        return min((w.hello.max_model_len for w in self.workers.values()), default=None)

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def worker_seconds(self) -> float:
        """Total time workers have been live on this gateway (what a price per GPU-hour is charged on)."""
        now = trio.current_time()
        return self._retired_worker_seconds + sum(now - w.joined for w in self.workers.values())

    def pending_aborts(self) -> dict[str, int]:
        """Requests per worker waiting for their Abort to be sent (the gateway -> worker IPC backlog)."""
        return {wid: len(ids) for wid, ids in self._aborts.items()}

    def retry_after(self) -> float:
        """An honest estimate of when a refused request could be admitted."""
        if not self.workers:
            eta = self._restart_eta()
            return 5.0 if eta is None else eta
        return max(1.0, min(w.slot_eta() for w in self.workers.values()))

    # ---- requests -------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: dict[str, SamplingValue],
                     cache_salt: str | None, deadline: float | None, weight: float = 1.0,
                     trace_context: dict[str, str] | None = None) -> RequestHandle:
        """Pick a worker and send it the request. Raises APIError(503) when no worker can take it."""
        if not self.workers:
            raise unavailable("no worker is ready to serve this model", self.retry_after(), "no_worker")
        keys = prefix_keys(cache_salt, prompt_ids)
        wid = self.router.choose([w.load() for w in self.workers.values()], keys, len(prompt_ids))
        if wid is None:
            raise unavailable("all workers are at capacity; retry later", self.retry_after())
        w = self.workers[wid]
        handle = RequestHandle(request_id, wid, len(prompt_ids))
        self._requests[request_id] = handle
        w.requests[request_id] = handle
        w.prompt_tokens += len(prompt_ids)
        msg = Generate(request_id, prompt_ids, sampling, cache_salt, weight, deadline, trace_context or None)
        try:
            await self._send(w, msg)
        except BaseException:  # cancelled or failed: maybe sent, maybe not; Abort is idempotent either way
            self.release(handle)
            raise
        self.router.record(keys, wid)
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The consumer is done with ``handle``; abort it on its worker unless it finished there. Sync and
        idempotent, so every ``finally`` can call it (also from a cancelled task)."""
        if handle.released:
            return
        handle.released = True
        self._requests.pop(handle.request_id, None)
        w = self.workers.get(handle.worker_id)
        if w is None or w.requests.pop(handle.request_id, None) is None:
            return  # its worker died (or was replaced): nothing runs there any more
        w.prompt_tokens -= handle.prompt_len
        if handle.finished:
            d = trio.current_time() - handle.started
            w.service_time = d if w.service_time is None else (1 - _EWMA_ALPHA) * w.service_time + _EWMA_ALPHA * d
        else:
            self._queue_abort(w.worker_id, handle.request_id)

    def process_exited(self, worker_id: str, pid: int) -> None:
        """The supervisor saw a local worker process exit: fail its requests now, not after heartbeats."""
        self._exited_pids.add(pid)
        w = self.workers.get(worker_id)
        if w is not None and w.hello.pid == pid:
            self._mark_dead(w, "process exited")

    # ---- internals: sending -------------------------------------------------------------------

    async def _send_raw(self, w: WorkerState, msg: GatewayToWorker) -> None:
        async with self._send_lock:
            # Bounded: a worker whose pipe stays full this long is not reading; it is treated as dead.
            with trio.fail_after(self.timing.ipc_send_timeout):
                await router_send(self._sock, w.identity, msg)

    async def _send(self, w: WorkerState, msg: GatewayToWorker) -> None:
        try:
            await self._send_raw(w, msg)
        except (PeerUnreachable, trio.TooSlowError) as e:
            self._mark_dead(w, f"send failed: {type(e).__name__}")
            raise RequestFailed("worker_died", f"worker {w.worker_id} is unreachable") from e

    def _queue_abort(self, worker_id: str, request_id: str) -> None:
        self._aborts[worker_id].add(request_id)
        self._abort_wakeup.set()

    async def _abort_loop(self) -> None:
        while True:
            await self._abort_wakeup.wait()
            self._abort_wakeup = trio.Event()
            batch, self._aborts = self._aborts, defaultdict(set)
            for wid, ids in batch.items():
                w = self.workers.get(wid)
                if w is None:
                    continue  # gone: its KV went with it
                try:
                    await self._send(w, Abort(sorted(ids)))
                except RequestFailed:
                    pass  # _send already declared the worker dead

    # ---- internals: receiving -----------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                identity, msg = await router_recv(self._sock)
            except trio.ClosedResourceError:
                return
            self._on_message(identity, msg)

    def _on_message(self, identity: bytes, msg: WorkerToGateway) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return
        wid = identity.decode(errors="replace")
        w = self.workers.get(wid)
        if w is None:
            w = self._maybe_revive(wid, identity, msg)
            if w is None:
                return
        w.last_seen = trio.current_time()
        if isinstance(msg, Stats):
            w.stats = msg
        elif isinstance(msg, StepOutputs):
            self._on_step(w, msg)
        elif isinstance(msg, RequestError):
            h = w.requests.get(msg.request_id)
            if h is not None:
                h.fail(msg.code, msg.message)
        elif isinstance(msg, Goodbye):
            self._mark_dead(w, f"said goodbye ({msg.reason})")

    def _on_step(self, w: WorkerState, msg: StepOutputs) -> None:
        now = trio.current_time()
        self.observer.iteration(w.worker_id, msg.num_batched_tokens)
        for out in msg.outputs:
            if out.timings is not None:  # also for requests nobody waits for: queue/prefill/decode are real
                self.observer.engine_finished(w.worker_id, out.timings)
            h = w.requests.get(out.request_id)
            if h is not None:
                if out.new_token_ids:
                    if h.last_token_at is not None:
                        self.observer.inter_token(w.worker_id, now - h.last_token_at)
                    h.last_token_at = now
                h.push(out)
            elif out.finish_reason is None:
                self._queue_abort(w.worker_id, out.request_id)  # nobody waits for it: free its KV

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        if identity != hello.worker_id.encode():
            log.warning("ignoring Hello whose worker id does not match its socket identity")
            return
        if hello.model != self.model_name:
            if hello.worker_id not in self._refused:
                self._refused.add(hello.worker_id)
                log.warning("ignoring worker %s: it serves %r, this gateway serves %r", hello.worker_id,
                            hello.model, self.model_name)
            return
        old = self.workers.get(hello.worker_id)
        if old is not None and old.hello.pid == hello.pid:
            old.hello, old.last_seen = hello, trio.current_time()  # same process re-introducing itself
            return
        if old is not None:
            self._mark_dead(old, "replaced by a new process with the same id")
        self._known_hellos[hello.worker_id] = hello
        if len(self.hello_times) < 1024:  # bounded: external workers' pids are never popped
            self.hello_times.setdefault(hello.pid, trio.current_time())
        self.workers[hello.worker_id] = WorkerState(hello, identity, trio.current_time(), trio.current_time())
        log.info("worker %s ready (pid %d, max_model_len %d, %d KV blocks of %d)", hello.worker_id, hello.pid,
                 hello.max_model_len, hello.num_kv_blocks, hello.block_size)

    def _maybe_revive(self, wid: str, identity: bytes, msg: WorkerToGateway) -> WorkerState | None:
        # A worker declared dead for missed heartbeats (a stall, a network blip) that talks again rejoins
        # with no requests (outputs of requests we failed are then aborted like any orphan); one whose
        # process we saw exit never does (its last frames may still be queued on the socket).
        hello = self._known_hellos.get(wid)
        if hello is None or hello.pid in self._exited_pids or not isinstance(msg, (Stats, StepOutputs)):
            return None
        log.warning("worker %s is talking again; taking it back", wid)
        w = WorkerState(hello, identity, trio.current_time(), trio.current_time())
        self.workers[wid] = w
        return w

    def _mark_dead(self, w: WorkerState, reason: str) -> None:
        if self.workers.get(w.worker_id) is not w:
            return
        del self.workers[w.worker_id]
        self._retired_worker_seconds += trio.current_time() - w.joined
        self.router.forget_worker(w.worker_id)
        log.warning("worker %s lost (%s); failing %d in-flight requests", w.worker_id, reason, len(w.requests))
        for h in w.requests.values():
            h.fail("worker_died", f"the worker serving this request failed ({reason})")
        w.requests.clear()

    async def _monitor_loop(self) -> None:
        while True:
            await trio.sleep(MONITOR_INTERVAL_S)
            now = trio.current_time()
            for w in list(self.workers.values()):
                if now - w.last_seen > self.timing.heartbeat_timeout:
                    self._mark_dead(w, f"no heartbeat for {now - w.last_seen:.1f}s")


def unix_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.time() + timeout


def ceil_seconds(x: float) -> int:
    return max(1, math.ceil(x))
