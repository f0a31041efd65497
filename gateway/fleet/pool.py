"""The gateway's view of its workers: who is alive, what runs where, and the one ROUTER socket to them.

``WorkerPool`` is the single owner of the worker table, the in-flight request table and the socket. Its tasks
(started with ``nursery.start(pool.run)``): one receiver (the only reader of the socket) dispatching worker
messages to request handles, one monitor telling frozen and hung workers from slow ones, and one sender per
live worker (``gateway.fleet.worker_link``). Route handlers call ``submit`` and ``release`` (sync: safe in any
``finally``); neither ever waits on a socket.

A worker is alive from its Hello until it is *dead* (its process exited, it said Goodbye, or a send to it
failed), *frozen* (no frame at all for ``heartbeat_timeout``: its I/O thread, which heartbeats whatever the
engine does, is stopped) or *hung* (its heartbeats say one step has run past ``step_timeout``); then every
request on it fails at once, and a frozen or hung worker the supervisor started is killed and restarted. A
*slow* worker (heartbeats arrive, a step runs long) is only load. The worker's heartbeats list the requests it
holds; any the gateway does not track (given up on, released while the Abort was in flight, or from a gateway
that restarted) is aborted, so a worker heard from again never runs work for nobody. A *draining* worker
(``drain``, ``gateway.fleet.drain``) gets no new requests, finishes its own and says Goodbye; nothing fails.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable

import trio

from gateway.base.errors import APIError, unavailable
from gateway.base.handle import PendingBudget, RequestHandle
from gateway.config import AdmissionConfig, TimingConfig
from gateway.fleet.drain import drain_worker
from gateway.fleet.identities import WorkerIdentities
from gateway.fleet.routing import Placement, Router, WorkerLoad, adapter_key, cache_key, prefix_keys
from gateway.fleet.worker_link import Outgoing, open_outbox, run_sender
from gateway.fleet.worker_state import NoObserver, PoolObserver, WorkerState
from ipc.messages import (Abort, Generate, Goodbye, Hello, Refused, RequestError, Shutdown, Stats, StepOutputs,
                          WorkerToGateway)
from ipc.sampling import SamplingParams
from ipc.transport import PeerUnreachable, TrioZmqSocket, router_recv_from, router_try_send
from tenancy.tiers import BASE_SHARE, DEFAULT_TIER, tier as tier_named

log = logging.getLogger("kvgate.gateway.pool")

MONITOR_INTERVAL_S = 0.25
_EWMA_ALPHA = 0.2  # weight of the newest request duration in the service-time average
REABORT_AFTER_S = 2.0  # a request the worker still lists this long after its Abort was queued is aborted again


class WorkerPool:
    def __init__(self, sock: TrioZmqSocket, model_name: str, timing: TimingConfig, admission: AdmissionConfig,
                 restart_eta: Callable[[], float | None] = lambda: None,
                 observer: PoolObserver | None = None) -> None:
        self._sock = sock
        self.model_name = model_name
        self.timing = timing
        self.router = Router(admission)
        self._restart_eta = restart_eta  # the supervisor's estimate of when a worker comes (back) up
        # Kills a local worker process the monitor gave up on (set by the supervisor); True if it was ours.
        self.kill_local: Callable[[str, int], bool] = lambda worker_id, pid: False
        self.workers: dict[str, WorkerState] = {}
        self.pending = PendingBudget()  # output waiting for slow clients, all streams together (handle.py)
        self.identities = WorkerIdentities()  # which connection speaks for which worker (its authorize: CURVE's)
        self._requests: dict[str, RequestHandle] = {}
        self._nursery: trio.Nursery | None = None  # runs the per-worker senders
        self._known_hellos: dict[str, Hello] = {}  # last Hello per worker id: lets a worker we gave up on rejoin
        self._exited_pids: set[int] = set()  # local workers whose process is gone: never revive those
        self._refused: set[str] = set()  # worker ids already warned about (wrong model)
        self.hello_times: dict[int, float] = {}  # pid -> trio time of its first Hello (the supervisor pops it)
        self.observer: PoolObserver = observer or NoObserver()
        self._retired_worker_seconds = 0.0  # live time of workers that are gone
        self.losses: Counter[str] = Counter()  # workers lost, by kind: exited, goodbye, drained, send_failed, frozen, hung
        self.reconciled_aborts = 0  # requests a worker held that this gateway did not track, aborted
        self._drained_pids: set[int] = set()  # workers told to drain: their exit is a restart, not a crash
        self._hung_at: dict[str, int] = {}  # worker id -> its steps_done when given up as hung (not back yet)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._monitor_loop)
            task_status.started()

    async def shutdown_workers(self, worker_ids: set[str]) -> None:
        """Best effort, never waiting: tell these workers to exit now (running requests are dropped). Workers
        started by hand are left alone: they outlive a gateway restart and re-introduce themselves to the
        next one."""
        for w in [w for w in self.workers.values() if w.worker_id in worker_ids]:
            try:
                router_try_send(self._sock, w.identity, Shutdown())
            except (PeerUnreachable, trio.ClosedResourceError, trio.BusyResourceError):
                pass
        await trio.lowlevel.checkpoint()

    # ---- queries --------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Some worker takes new requests (a draining one does not)."""
        return any(not w.draining for w in self.workers.values())

    @property
    def max_model_len(self) -> int | None:
        return min((w.hello.max_model_len for w in self.workers.values()), default=None)

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def inflight(self) -> list[RequestHandle]:
        return list(self._requests.values())

    def worker_seconds(self) -> float:
        """Total time workers have been live on this gateway (what a price per GPU-hour is charged on)."""
        now = trio.current_time()
        return self._retired_worker_seconds + sum(now - w.joined for w in self.workers.values())

    def pending_aborts(self) -> dict[str, int]:
        """Requests per worker whose Abort was queued and that the worker has not yet confirmed gone."""
        return {wid: len(w.aborting) for wid, w in self.workers.items()}

    def retry_after(self) -> float:
        """An honest estimate of when a refused request could be admitted."""
        if not self.workers:
            eta = self._restart_eta()
            return 5.0 if eta is None else eta
        return max(1.0, min(w.slot_eta() for w in self.workers.values()))

    # ---- requests -------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     cache_salt: str | None, deadline: float | None, weight: float = 1.0,
                     trace_context: dict[str, str] | None = None, near: str | None = None,
                     priority: int = 0, tier: str = DEFAULT_TIER, lora: str | None = None,
                     adapter: str | None = None, prompt_cache_key: str | None = None) -> RequestHandle:
        """Pick a worker and queue the request for it (``near``: the worker of the same request's first
        sequence; ``tier``: the class whose share of the admission bounds it may fill; ``lora``: the adapter's
        directory the worker loads, ``adapter`` its registered name, for metrics). Raises APIError(503) when
        no worker can take it, APIError(429) when only the headroom kept for higher tiers could."""
        await trio.lowlevel.checkpoint()
        open_ = [w.load() for w in self.workers.values() if not w.draining]  # a draining worker takes nothing new
        if not open_:
            raise unavailable("no worker is ready to serve this model", self.retry_after(), "no_worker")
        # A prefix computed under one adapter is never reused under another (the worker's cache keys include it):
        # so the affinity keys include it too, or a prompt would be drawn to a worker whose cache cannot serve it.
        keys = prefix_keys(cache_salt if lora is None else f"{cache_salt or ''}\x1flora:{lora}", prompt_ids)
        if lora is not None:  # no known prefix: the worker that ran the adapter last likely holds it resident
            keys.append(adapter_key(lora))
        if prompt_cache_key is not None:  # the client's word on what shares a prefix: first
            keys.insert(0, cache_key(cache_salt, prompt_cache_key))
        tenant = cache_salt or ""  # the workers' fair queues share by salt (one a tenant): so does the router
        who = Placement(tenant, weight, near, tier_named(tier).capacity_share)
        wid = self.router.choose(open_, keys, len(prompt_ids), who)
        if wid is None:
            raise self._refusal(open_, len(prompt_ids), who, tier)
        w = self.workers[wid]
        msg = Generate(request_id, prompt_ids, sampling, cache_salt, weight, deadline, trace_context or None, priority,
                       lora)
        try:
            w.outbox.send_nowait(msg)
        except trio.WouldBlock:  # the worker has not read its pipe for a while: it can't take more now
            raise unavailable("the worker's queue is full; retry later", self.retry_after()) from None
        handle = RequestHandle(request_id, wid, len(prompt_ids), budget=self.pending, tenant=tenant, weight=weight,
                               adapter=adapter)
        self._requests[request_id] = handle
        w.hold(handle)
        self.router.record(keys, wid)
        return handle

    def never_admits(self, sequences: int, prompt_tokens: int, longest: int, tier: str) -> str | None:
        """Why the open workers, idle, could never take all of one request's sequences at once (``Router``), or
        None (also when no worker is open: that is a 503 of its own)."""
        n = sum(1 for w in self.workers.values() if not w.draining)
        return None if n == 0 else self.router.never_admits(n, sequences, prompt_tokens, longest,
                                                            tier_named(tier).capacity_share)

    def _refusal(self, loads: list[WorkerLoad], prompt_len: int, who: Placement, tier: str) -> APIError:
        retry_after = self.retry_after()
        if who.share < BASE_SHARE:
            # Per tier: the time until enough requests end on the likeliest worker to bring it under this tier's
            # bounds (a lower tier's are lower, so it is told to wait longer).
            eta = min(self.router.over_share(w, who.share) * self.workers[w.worker_id].slot_eta() for w in loads)
            retry_after = max(retry_after, eta)
        if self.router.reserved(loads, prompt_len, who):
            err = APIError(429, f"the {tier} tier may fill {who.share:.0%} of each worker's admission bounds and "
                                "that is in use; the rest is kept for higher tiers. Retry later",
                           code="tier_capacity_exceeded", retry_after=retry_after)
        else:
            err = unavailable("all workers are at capacity; retry later", retry_after)
        self.observer.refused(tier, err.code or "refused")
        return err

    def release(self, handle: RequestHandle) -> None:
        """The consumer is done with ``handle``; abort it on its worker unless it finished there. Sync and
        idempotent, so every ``finally`` can call it (also from a cancelled task)."""
        if handle.released:
            return
        handle.released = True
        handle.close()
        self._requests.pop(handle.request_id, None)
        w = self.workers.get(handle.worker_id)
        if w is None or w.drop(handle.request_id) is None:
            return  # its worker died (or was replaced): nothing runs there any more
        if handle.finished:
            d = trio.current_time() - handle.started
            w.service_time = d if w.service_time is None else (1 - _EWMA_ALPHA) * w.service_time + _EWMA_ALPHA * d
        else:
            self._queue_abort(w, [handle.request_id])

    def drain(self, worker_id: str, timeout: float) -> WorkerState:
        """Route nothing new to ``worker_id`` from now on and have it finish its requests and exit (its
        supervisor starts a fresh one at once); past ``timeout`` seconds what it still holds fails with
        ``drain_timeout``. Idempotent. Raises KeyError when no such worker is live."""
        w = self.workers[worker_id]
        if w.draining:
            return w
        w.draining_since = trio.current_time()
        self.router.forget_worker(worker_id)  # its prefix cache leaves with its process
        self._drained_pids.add(w.hello.pid)
        log.info("draining worker %s (pid %d, %d requests in flight, timeout %gs)", worker_id, w.hello.pid,
                 len(w.requests), timeout)
        if self._nursery is not None:  # None only in unit tests that never run the pool
            self._nursery.start_soon(drain_worker, w, timeout, self.kill_local)
        return w

    def drained(self, pid: int) -> bool:
        """Whether the process ``pid`` exited because it was told to drain (its supervisor restarts it at once)."""
        return pid in self._drained_pids

    def process_exited(self, worker_id: str, pid: int) -> None:
        """The supervisor saw a local worker process exit: fail its requests now, not after heartbeats."""
        self._exited_pids.add(pid)
        w = self.workers.get(worker_id)
        if w is not None and w.hello.pid == pid:
            self._mark_dead(w, "process exited", "exited")

    # ---- internals: sending -------------------------------------------------------------------

    def _queue_abort(self, w: WorkerState, request_ids: list[str]) -> None:
        now = trio.current_time()
        for rid in request_ids:
            w.aborting[rid] = now
        try:
            w.outbox.send_nowait(Abort(request_ids))
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass  # not lost: the worker's next heartbeat lists these ids and reconciliation aborts them again

    def _start_worker(self, hello: Hello, identity: bytes) -> WorkerState:
        now = trio.current_time()
        tx, rx = open_outbox()
        w = WorkerState(hello, identity, now, now, outbox=tx)
        self.workers[hello.worker_id] = w
        if self._nursery is not None:
            self._nursery.start_soon(self._run_sender, w, rx)
        return w

    async def _run_sender(self, w: WorkerState, rx: trio.MemoryReceiveChannel[Outgoing]) -> None:
        with w.sender_scope:  # cancelled when the worker is marked dead
            await run_sender(self._sock, w.identity, rx, self.timing.ipc_send_timeout,
                             lambda reason: self._mark_dead(w, reason, "send_failed"))

    # ---- internals: receiving -----------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                identity, msg, key = await router_recv_from(self._sock)
            except trio.ClosedResourceError:
                return
            self._on_message(identity, msg, key)

    def _on_message(self, identity: bytes, msg: WorkerToGateway, key: str | None = None) -> None:
        if isinstance(msg, Hello):
            self._on_hello(identity, msg, key)
            return
        wid = self.identities.worker_for(identity, key)
        if wid is None:
            return  # no admitted Hello came over this connection: nobody's frame
        w = self.workers.get(wid)
        if w is None:
            w = self._maybe_revive(wid, identity, msg)
            if w is None:
                return
        w.last_seen = trio.current_time()
        if isinstance(msg, Stats):
            self._on_stats(w, msg)
        elif isinstance(msg, StepOutputs):
            self._on_step(w, msg)
        elif isinstance(msg, RequestError):
            h = w.requests.get(msg.request_id)
            if h is not None:
                h.fail(msg.code, msg.message)
        elif isinstance(msg, Goodbye):
            self._mark_dead(w, f"said goodbye ({msg.reason})", "drained" if w.draining else "goodbye")

    def _on_stats(self, w: WorkerState, msg: Stats) -> None:
        """Take the heartbeat, and reconcile: abort what the worker holds that nobody here waits for."""
        now = trio.current_time()
        w.stats, w.stats_at = msg, now
        held = set(msg.request_ids)
        w.aborting = {rid: t for rid, t in w.aborting.items() if rid in held}
        unknown = [rid for rid in msg.request_ids if rid not in w.requests
                   and now - w.aborting.get(rid, -math.inf) >= REABORT_AFTER_S]
        if unknown:
            self.reconciled_aborts += len(unknown)
            log.info("worker %s holds %d requests this gateway does not track; aborting them", w.worker_id,
                     len(unknown))
            self._queue_abort(w, unknown)

    def _on_step(self, w: WorkerState, msg: StepOutputs) -> None:
        now = trio.current_time()
        # a step's further frames (workers.process.step_frames) say 0: one step, counted once
        if msg.num_batched_tokens:
            self.observer.iteration(w.worker_id, msg.num_batched_tokens)
        orphans: list[str] = []
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
                if h.overflowed:  # its client stopped reading: free its KV rather than hold its output
                    log.info("request %s cut: its client fell too far behind", h.request_id)
                    self.release(h)
            elif out.finish_reason is None and out.request_id not in w.aborting:
                orphans.append(out.request_id)  # nobody waits for it: free its KV
        if orphans:
            self._queue_abort(w, orphans)

    def _on_hello(self, identity: bytes, hello: Hello, key: str | None = None) -> None:
        refusal = self.identities.refusal(key, hello.worker_id)
        if refusal is not None:
            try:  # over the refused connection itself: it learns why and exits; nothing else goes there
                router_try_send(self._sock, identity, Refused(f"worker id {hello.worker_id!r} refused: {refusal}"))
            except (PeerUnreachable, trio.BusyResourceError):
                pass
            return
        if hello.model != self.model_name:
            if hello.worker_id not in self._refused:
                self._refused.add(hello.worker_id)
                log.warning("ignoring worker %s: it serves %r, this gateway serves %r", hello.worker_id,
                            hello.model, self.model_name)
            return
        self.identities.bind(identity, hello.worker_id, key)
        if hello.worker_id in self._hung_at:
            known = self._known_hellos.get(hello.worker_id)
            if known is not None and known.pid == hello.pid:
                return  # the process given up as hung, reconnected: its heartbeats bring it back (_maybe_revive)
            del self._hung_at[hello.worker_id]  # a new process under that id starts afresh
        old = self.workers.get(hello.worker_id)
        if old is not None and old.hello.pid == hello.pid and old.identity == identity:
            old.hello, old.last_seen = hello, trio.current_time()  # same socket re-introducing itself
            return
        if old is not None:
            self._mark_dead(old, "replaced by a new process with the same id", "replaced")
        self._known_hellos[hello.worker_id] = hello
        if len(self.hello_times) < 1024:  # bounded: external workers' pids are never popped
            self.hello_times.setdefault(hello.pid, trio.current_time())
        self._start_worker(hello, identity)
        log.info("worker %s ready (pid %d, max_model_len %d, %d KV blocks of %d, step budget %d tokens)",
                 hello.worker_id, hello.pid, hello.max_model_len, hello.num_kv_blocks, hello.block_size,
                 hello.max_num_batched_tokens)

    def _maybe_revive(self, wid: str, identity: bytes, msg: WorkerToGateway) -> WorkerState | None:
        # A worker given up on (frozen, hung: a stall, a network blip) that talks again rejoins with no
        # requests; its first heartbeat lists what it still holds, and reconciliation aborts all of it. One
        # whose process we saw exit never does (its last frames may still be queued on the socket).
        hello = self._known_hellos.get(wid)
        if hello is None or hello.pid in self._exited_pids or not isinstance(msg, (Stats, StepOutputs)):
            return None
        if wid in self._hung_at:
            # Given up as hung: its I/O thread heartbeats all along, so only a heartbeat showing the step it hung
            # in done (and the one now running, if any, within the step timeout) brings it back. Taking it back
            # at any frame made an external hung worker flap: back, requests routed to it, hung again a monitor
            # tick later, those requests failed.
            if not (isinstance(msg, Stats) and msg.steps_done > self._hung_at[wid]
                    and (msg.step_elapsed is None or msg.step_elapsed <= self.timing.step_timeout)):
                return None
            del self._hung_at[wid]
        log.warning("worker %s is talking again; taking it back", wid)
        return self._start_worker(hello, identity)

    def _mark_dead(self, w: WorkerState, reason: str, kind: str) -> None:
        if self.workers.get(w.worker_id) is not w:
            return
        del self.workers[w.worker_id]
        self.losses[kind] += 1
        w.sender_scope.cancel()
        w.outbox.close()
        self._retired_worker_seconds += trio.current_time() - w.joined
        self.router.forget_worker(w.worker_id)
        w.gone.set()
        unfinished = sum(1 for h in w.requests.values() if not h.finished)  # finished ones wait for their reader
        log.log(logging.INFO if kind == "drained" else logging.WARNING, "worker %s lost (%s); failing %d in-flight "
                "requests", w.worker_id, reason, unfinished)
        for h in w.requests.values():
            h.fail("worker_died", f"the worker serving this request failed ({reason})")
        w.requests.clear()

    def _give_up(self, w: WorkerState, reason: str, kind: str) -> None:
        """Frozen or hung: fail its requests and, if the supervisor started it, have it killed (restarted)."""
        self._mark_dead(w, reason, kind)
        if kind == "hung" and w.stats is not None:
            self._hung_at[w.worker_id] = w.stats.steps_done
        if self.kill_local(w.worker_id, w.hello.pid):
            log.warning("killed worker %s (pid %d): %s; the supervisor restarts it", w.worker_id, w.hello.pid, kind)

    async def _monitor_loop(self) -> None:
        last = trio.current_time()
        while True:
            await trio.sleep(MONITOR_INTERVAL_S)
            now = trio.current_time()
            stalled, last = now - last > self.timing.heartbeat_timeout / 2, now
            if stalled:
                # This event loop itself was blocked: frames may be waiting unread in our socket. Silence
                # measured across our own stall says nothing about the workers; look again next round.
                continue
            for w in list(self.workers.values()):
                silent = now - w.last_seen
                elapsed = w.step_elapsed(now)
                if silent > self.timing.heartbeat_timeout:
                    self._give_up(w, f"frozen: no frame for {silent:.1f}s", "frozen")
                elif elapsed is not None and elapsed > self.timing.step_timeout:
                    self._give_up(w, f"hung: one step has run {elapsed:.0f}s", "hung")


def unix_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.time() + timeout


def ceil_seconds(x: float) -> int:
    return max(1, math.ceil(x))
