"""What the gateway knows about one live worker, and the hook through which the pool reports what its workers
did (engine timings, iterations, token gaps) to whoever keeps metrics, without the pool knowing about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gateway.handle import RequestHandle
from gateway.routing import WorkerLoad
from ipc.messages import EngineTimings, Hello, Stats


class PoolObserver(Protocol):
    """Called from the pool's receive loop: must be quick and must not raise."""

    def iteration(self, worker_id: str, num_batched_tokens: int) -> None: ...
    def inter_token(self, worker_id: str, seconds: float) -> None: ...
    def engine_finished(self, worker_id: str, timings: EngineTimings) -> None: ...


class NoObserver:
    def iteration(self, worker_id: str, num_batched_tokens: int) -> None:
        pass

    def inter_token(self, worker_id: str, seconds: float) -> None:
        pass

    def engine_finished(self, worker_id: str, timings: EngineTimings) -> None:
        pass


@dataclass
class WorkerState:
    hello: Hello
    identity: bytes
    last_seen: float  # trio clock
    joined: float = 0.0  # trio clock when it became live (worker-time, hence cost, accrues from here)
    stats: Stats | None = None
    requests: dict[str, RequestHandle] = field(default_factory=dict)
    prompt_tokens: int = 0
    service_time: float | None = None  # EWMA of request durations (s); drives retry-after

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, len(self.requests), self.prompt_tokens,
                          self.stats.kv_usage if self.stats else 0.0)

    def slot_eta(self) -> float:
        """Seconds until one of this worker's requests is likely to finish (frees an admission slot)."""
        if self.service_time is None:
            return 1.0
        return self.service_time / max(1, len(self.requests))

    def pending_outputs(self) -> int:
        """Outputs received from this worker that their consumers have not taken yet (slow clients)."""
        return sum(h.num_pending() for h in self.requests.values())
