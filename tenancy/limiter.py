"""The in-process `RateLimiter`: the algorithm of `tenancy.limits_spec` over Python objects, for one gateway process
(pure: the clock is injected, no I/O except the ledger on a budget's first sight, no threads of its own). The clock
is wall time (seconds since the epoch) because budget periods are calendar periods.

`tenancy.redis_limiter.RedisLimiter` is the shared backend (one limit across every gateway on one Redis). The public
types live in `tenancy.limits` and are re-exported here, where the gateway has always imported them from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tenancy.limits import (
    BudgetUsed, Decision, DenyReason, Dimension, RateLimiter, RateLimitInfo, Scope, format_duration)
from tenancy.limits_spec import (
    CONCURRENCY_RETRY_HINT_S, UNAVAILABLE_RETRY_S, WINDOW_S, Counters, Levels, budget_transition, check,
    has_budget, period_end, period_start, precheck, rate_limit_info, refill, settled_budget, settled_tokens)

__all__ = [
    "CONCURRENCY_RETRY_HINT_S", "UNAVAILABLE_RETRY_S", "WINDOW_S", "BudgetUsed", "Decision", "DenyReason",
    "Dimension", "Limiter", "RateLimitInfo", "RateLimiter", "Scope", "format_duration", "period_end",
    "period_start", "precheck"]


@dataclass(frozen=True)
class _Bucket:
    """A bucket as last written (by an admit that consumed or a settle that refunded); `refill` gives its level at
    any later time. Reads never write it back, so its arithmetic is the Lua backend's, operation for operation."""
    level: float
    updated: float


def _level(bucket: _Bucket | None, capacity: int | None, now: float) -> float | None:
    """The level now; None where unlimited. A bucket whose limit is lifted keeps what it held, should it return."""
    if capacity is None:
        return None
    return refill(None if bucket is None else bucket.level, 0.0 if bucket is None else bucket.updated, capacity, now)


@dataclass
class _ScopeState:
    requests: _Bucket | None = None  # None: never written, i.e. full
    tokens: _Bucket | None = None
    in_flight: set[str] = field(default_factory=set)
    budget_used: int = 0
    budget_period_end: float = 0.0  # 0: no budget counter yet

    def levels(self, scope: Scope, now: float) -> Levels:
        return (_level(self.requests, scope.quota.rpm, now), _level(self.tokens, scope.quota.tpm, now))

    def counters(self, scope: Scope, now: float) -> Counters:
        return Counters(self.levels(scope, now), self.budget_used, self.budget_period_end, len(self.in_flight))


@dataclass(frozen=True)
class _Reservation:
    scopes: tuple[Scope, ...]
    tokens: int
    budget_period_end: dict[str, float | None]  # per scope name; None where no budget was charged


class Limiter:
    """The in-process `RateLimiter`: one gateway process, no I/O except `budget_used` on a scope's first sight."""
    blocking: bool = False

    def __init__(self, clock: Callable[[], float], budget_used: BudgetUsed | None = None) -> None:
        self._clock = clock
        self._budget_used = budget_used
        self._lock = threading.Lock()  # the gateway may call from threads; decisions must be atomic
        self._states: dict[str, _ScopeState] = {}
        self._reservations: dict[str, _Reservation] = {}

    def in_flight(self, scope: str) -> int:
        with self._lock:
            state = self._states.get(scope)
            return len(state.in_flight) if state else 0

    def admit(self, request_id: str, scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> Decision:
        cost, never = precheck(scopes, prompt_tokens, max_tokens)
        if never is not None:
            return never
        ledger = self._budget_used
        seeds: dict[tuple[str, float], int] = {}
        while True:
            with self._lock:
                if request_id in self._reservations:
                    raise ValueError(f"request {request_id!r} already holds a reservation")
                now = self._clock()
                unseeded = self._unseeded(scopes, now, seeds)
                if ledger is None or not unseeded:
                    return self._admit_locked(request_id, scopes, cost, now, seeds)
            # First sight of a budget in this period: ask the ledger outside the lock (it may be a database read).
            for name, (start, end) in unseeded.items():
                seeds[(name, end)] = ledger(name, start)

    def _admit_locked(self, request_id: str, scopes: Sequence[Scope], cost: int, now: float,
                      seeds: dict[tuple[str, float], int]) -> Decision:
        states = [self._refresh(s, now, seeds) for s in scopes]
        denial = check(scopes, [st.counters(s, now) for s, st in zip(scopes, states)], cost, now)
        if denial is not None:
            return denial
        for scope, state in zip(scopes, states):
            requests, tokens = state.levels(scope, now)
            if requests is not None:
                state.requests = _Bucket(requests - 1, now)
            if tokens is not None:
                state.tokens = _Bucket(tokens - cost, now)
            state.in_flight.add(request_id)
            if has_budget(scope):
                state.budget_used += cost
        self._reservations[request_id] = _Reservation(
            tuple(scopes), cost,
            {s.name: st.budget_period_end if has_budget(s) else None for s, st in zip(scopes, states)})
        return Decision(True, info=rate_limit_info(scopes, [st.levels(s, now) for s, st in zip(scopes, states)]))

    def settle(self, request_id: str, used_tokens: int) -> bool:
        """End of a request on any path: refund `reserved - used` tokens and free the slot. Idempotent: returns
        False (and does nothing) for an unknown or already settled request."""
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        with self._lock:
            reservation = self._reservations.pop(request_id, None)
            if reservation is None:
                return False
            now = self._clock()
            delta = reservation.tokens - used_tokens
            for scope in reservation.scopes:
                state = self._state(scope.name)
                tokens = _level(state.tokens, scope.quota.tpm, now)
                if tokens is not None and scope.quota.tpm is not None:
                    state.tokens = _Bucket(settled_tokens(tokens, delta, scope.quota.tpm), now)
                charged = reservation.budget_period_end[scope.name]
                if charged is not None and state.budget_period_end == charged:
                    # A reservation from a period that has since rolled over is not the new period's business.
                    state.budget_used = settled_budget(state.budget_used, delta)
                state.in_flight.discard(request_id)
            return True

    def peek(self, scopes: Sequence[Scope]) -> RateLimitInfo:
        with self._lock:
            now = self._clock()
            return rate_limit_info(scopes, [self._state(s.name).levels(s, now) for s in scopes])

    def renew(self) -> None:
        """Nothing to renew: in-process slots cannot outlive the process."""

    def close(self) -> None:
        """Nothing to release."""

    def _unseeded(self, scopes: Sequence[Scope], now: float, seeds: dict[tuple[str, float], int]
                  ) -> dict[str, tuple[float, float]]:
        """{scope name: (period start, period end)} of budget counters that must be seeded from the ledger first."""
        if self._budget_used is None:
            return {}
        out: dict[str, tuple[float, float]] = {}
        for scope in scopes:
            period = scope.quota.budget_period
            if not has_budget(scope) or period is None:
                continue
            state = self._states.get(scope.name)
            end = period_end(now, period)
            if (budget_transition(state.budget_period_end if state else 0.0, end, now) == "seed"
                    and (scope.name, end) not in seeds):
                out[scope.name] = (period_start(now, period), end)
        return out

    def _refresh(self, scope: Scope, now: float, seeds: dict[tuple[str, float], int]) -> _ScopeState:
        state = self._state(scope.name)
        period = scope.quota.budget_period
        if has_budget(scope) and period is not None:
            end = period_end(now, period)
            transition = budget_transition(state.budget_period_end, end, now)
            if transition != "keep":
                state.budget_used = 0 if transition == "rollover" else seeds.get((scope.name, end), 0)
                state.budget_period_end = end
        return state

    def _state(self, name: str) -> _ScopeState:
        return self._states.setdefault(name, _ScopeState())
