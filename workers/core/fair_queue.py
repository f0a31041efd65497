"""Weighted fair queuing over cache salts (tenants) for the waiting queue.

Start-time fair queuing on tokens: each salt has a virtual time that advances by tokens / weight each time
one of its requests is admitted; the salt with the smallest virtual time goes next, FCFS within a salt. A
salt that was idle starts at the current virtual time, so it cannot bank credit while away and one
tenant's burst cannot starve another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator

from workers.core.request import Request


def salt_key(req: Request) -> str:
    # The empty salt is a tenant like any other ("no salt" requests share one queue).
    return req.cache_salt or ""


def queue_key(req: Request) -> tuple[str, int]:
    """One FIFO per tenant and priority: a tenant's bulk requests never stand in front of its interactive ones."""
    return salt_key(req), req.priority


class FairQueue:
    def __init__(self) -> None:
        self._queues: dict[tuple[str, int], deque[Request]] = {}
        self._vtime: dict[tuple[str, int], float] = {}
        self._now = 0.0  # virtual time: start tag of the last admitted request
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def push(self, req: Request) -> None:
        self._activate(queue_key(req)).append(req)
        self._len += 1

    def push_front(self, req: Request) -> None:
        """A preempted request goes back to the head of its salt's queue (it arrived first)."""
        self._activate(queue_key(req)).appendleft(req)
        self._len += 1

    def _activate(self, key: tuple[str, int]) -> deque[Request]:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
            self._vtime[key] = max(self._vtime.get(key, 0.0), self._now)
        return q

    def peek(self, skip: Collection[tuple[str, int]] = (),
             rank: Callable[[Request], int] | None = None) -> Request | None:
        """Head of the queue with the least virtual time; ties go to the earliest arrival. With ``rank`` (the
        priority policy's effective level) the best-ranked heads compete first. Queues in ``skip`` (the
        scheduler's: their head waits for a prefix another request is computing) are passed over."""
        best: Request | None = None
        best_tag = (0, 0.0, 0.0)
        for key, q in self._queues.items():
            if key in skip:
                continue
            tag = (rank(q[0]) if rank is not None else 0, self._vtime[key], q[0].arrival_time)
            if best is None or tag < best_tag:
                best, best_tag = q[0], tag
        return best

    def pop(self, req: Request, cost_tokens: int) -> None:
        """Remove ``req`` (the current peek) and charge its salt ``cost_tokens / weight``."""
        key = queue_key(req)
        q = self._queues[key]
        if q[0] is not req:
            raise RuntimeError(f"{req.request_id} is not at the head of its queue")
        q.popleft()
        self._len -= 1
        self._now = self._vtime[key]
        self._vtime[key] += max(cost_tokens, 1) / max(req.weight, 1e-6)
        if not q:
            self._retire(key)

    def remove(self, req: Request) -> bool:
        """Take a request out wherever it is (abort). Returns whether it was queued."""
        key = queue_key(req)
        q = self._queues.get(key)
        if q is None or req not in q:
            return False
        q.remove(req)
        self._len -= 1
        if not q:
            self._retire(key)
        return True

    def _retire(self, key: tuple[str, int]) -> None:
        del self._queues[key]
        # A salt at or behind the clock would restart at the clock anyway: forget it (bounded memory).
        if self._vtime[key] <= self._now:
            del self._vtime[key]
        if not self._queues:  # all idle: drop everything behind the clock too
            self._vtime = {k: v for k, v in self._vtime.items() if v > self._now}
