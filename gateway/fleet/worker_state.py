"""What the gateway knows about one live worker, and the hook through which the pool reports what its workers
did (engine timings, iterations, token gaps) to whoever keeps metrics, without the pool knowing about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Protocol

import trio

from gateway.base.handle import RequestHandle
from gateway.fleet.routing import TenantCounts, WorkerLoad
from gateway.fleet.worker_link import Outgoing, open_outbox
from ipc.messages import EngineTimings, Hello, Stats

# A step running at least this long makes a worker "slow": load, shown in /metrics and top, never a failure.
SLOW_STEP_S: Final = 1.0


class PoolObserver(Protocol):
    """Called from the pool's receive loop: must be quick and must not raise."""

    def iteration(self, worker_id: str, num_batched_tokens: int) -> None: ...
    def inter_token(self, worker_id: str, seconds: float) -> None: ...
    def engine_finished(self, worker_id: str, timings: EngineTimings) -> None: ...
    def refused(self, tier: str, reason: str) -> None: ...  # ``submit`` found no worker for a request of ``tier``


class NoObserver:
    def iteration(self, worker_id: str, num_batched_tokens: int) -> None:
        pass

    def inter_token(self, worker_id: str, seconds: float) -> None:
        pass

    def engine_finished(self, worker_id: str, timings: EngineTimings) -> None:
        pass

    def refused(self, tier: str, reason: str) -> None:
        pass


def _outbox_send() -> trio.MemorySendChannel[Outgoing]:
    return open_outbox()[0]  # replaced by the pool, which keeps the receiving end for the worker's sender


@dataclass
class WorkerState:
    """One live worker. Liveness has four answers: dead (process gone, Goodbye, send failed), frozen (no
    frame at all for the heartbeat timeout), hung (its current step past the step timeout), and otherwise
    alive, where ``health`` says idle, busy or slow: a slow step is load, never a failure. A *draining* worker
    is alive but takes no new requests: it finishes those it holds, says Goodbye and exits."""

    hello: Hello
    identity: bytes
    last_seen: float  # trio clock of the last frame of any kind
    joined: float = 0.0  # trio clock when it became live (worker-time, hence cost, accrues from here)
    stats: Stats | None = None
    stats_at: float | None = None  # trio clock when ``stats`` arrived (its step_elapsed was true then)
    requests: dict[str, RequestHandle] = field(default_factory=dict)
    prompt_tokens: int = 0
    tenants: TenantCounts = field(default_factory=TenantCounts)  # ``requests`` by tenant: the router spreads them
    service_time: float | None = None  # EWMA of request durations (s); drives retry-after
    outbox: trio.MemorySendChannel[Outgoing] = field(default_factory=_outbox_send)
    sender_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    aborting: dict[str, float] = field(default_factory=dict)  # request id -> trio time its Abort was queued
    draining_since: float | None = None  # trio clock of the operator's drain: no new requests go here
    gone: trio.Event = field(default_factory=trio.Event)  # set when the pool drops it (dead, said goodbye)

    def step_elapsed(self, now: float) -> float | None:
        """How long the worker's current step has run by now (None between steps or before any Stats)."""
        s = self.stats
        if s is None or s.step_elapsed is None or self.stats_at is None:
            return None
        return s.step_elapsed + max(0.0, now - self.stats_at)

    def health(self, now: float) -> str:
        elapsed = self.step_elapsed(now)
        if elapsed is None:
            return "idle"
        return "slow" if elapsed >= SLOW_STEP_S else "busy"

    def outbox_depth(self) -> int:
        return self.outbox.statistics().current_buffer_used

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, len(self.requests), self.prompt_tokens,
                          self.stats.kv_usage if self.stats else 0.0, self.tenants)

    def hold(self, handle: RequestHandle) -> None:
        """``handle`` was sent here: count it in everything the router reads."""
        self.requests[handle.request_id] = handle
        self.prompt_tokens += handle.prompt_len
        self.tenants.add(handle.tenant, handle.weight, handle.prompt_len)

    def drop(self, request_id: str) -> RequestHandle | None:
        """Stop counting ``request_id`` here; its handle, or None when it was not held."""
        handle = self.requests.pop(request_id, None)
        if handle is not None:
            self.prompt_tokens -= handle.prompt_len
            self.tenants.remove(handle.tenant, handle.prompt_len)
        return handle

    def slot_eta(self) -> float:
        """Seconds until one of this worker's requests is likely to finish (frees an admission slot)."""
        if self.service_time is None:
            return 1.0
        return self.service_time / max(1, len(self.requests))

    def pending_outputs(self) -> int:
        """Outputs received from this worker that their consumers have not taken yet (slow clients)."""
        return sum(h.num_pending() for h in self.requests.values())
