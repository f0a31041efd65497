"""In-process rate, concurrency and budget limiter (pure: the clock is injected, no I/O, no threads of its own).

Semantics (issue 4):
- requests/minute and tokens/minute are token buckets of capacity `limit` refilled at `limit / 60` per second; a
  burst at one instant can therefore never be admitted past the limit.
- tokens RESERVE `prompt + max_tokens` at admission and SETTLE to the real count at the end: the difference is
  refunded (or, if the request somehow used more, charged as debt), so concurrent requests cannot overshoot.
- the token budget (per UTC day or month) is reserved and settled the same way.
- concurrency slots are taken at admission and given back by `settle`, which is idempotent per request id: call it
  on completion, error, cancel and worker death alike.
- a request that can never fit (over max_tokens_per_request, max_prompt_tokens, tpm or the whole budget) is
  reported as `never_fits` (a 400), distinct from a 429 that a retry can cure.
- the budget counter of a scope first seen in a period starts at what the ledger says it already used in that
  period (`budget_used(scope, period_start)`); a period that rolls over while running starts at 0.
The clock is wall time (seconds since the epoch) because budget periods are calendar periods.

`RateLimiter` is the interface the gateway calls; `Limiter` is the in-process implementation and
`tenancy.redis_limiter.RedisLimiter` the shared one (one limit across every gateway that uses the same Redis).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal, Protocol

from tenancy.models import BudgetPeriod, Quota

WINDOW_S = 60.0
_EPS = 1e-6  # float slack so that waiting exactly `retry_after` is always enough
CONCURRENCY_RETRY_HINT_S = 1.0  # a slot frees when some other request ends: unknowable, so only a hint

UNAVAILABLE_RETRY_S = 1.0  # the shared backend is down: retry soon (and a gateway skips it for this long)

DenyReason = Literal["rate_limit_exceeded", "concurrency", "insufficient_quota", "never_fits", "unavailable"]
Dimension = Literal["requests", "tokens", "budget", "concurrency"]
BudgetUsed = Callable[[str, float], int]
"""`budget_used(scope_name, since_unix)`: tokens the scope already used since then, per the ledger."""


@dataclass(frozen=True)
class Scope:
    """A counter namespace (e.g. 'tenant:ten_ab12' or 'key:key_cd34') and the quota that applies to it."""
    name: str
    quota: Quota


@dataclass(frozen=True)
class RateLimitInfo:
    """Values for OpenAI's x-ratelimit-* headers, from the most constrained scope; None where unlimited."""
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
                ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
                ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s)):
            if limit is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(reset)
        return out


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: DenyReason | None = None
    dimension: Dimension | None = None
    retry_after: float | None = None  # seconds; accurate for rpm/tpm denials
    message: str = ""
    info: RateLimitInfo = field(default_factory=RateLimitInfo)

    @property
    def http_status(self) -> int:
        if self.allowed:
            return 200
        if self.reason == "unavailable":
            return 503
        return 400 if self.reason == "never_fits" else 429

    def headers(self) -> dict[str, str]:
        out = self.info.headers()
        if self.reason == "insufficient_quota":
            out["x-should-retry"] = "false"  # OpenAI SDKs retry every 429 unless told not to
        elif self.retry_after is not None and not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
            out["retry-after-ms"] = str(math.ceil(self.retry_after * 1000))
        return out


def format_duration(seconds: float | None) -> str:
    """OpenAI's reset format: '20ms', '1s', '6m0s', '1.5s'."""
    if seconds is None or seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    rest_str = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_str}s" if minutes else f"{rest_str}s"


def period_start(now: float, period: BudgetPeriod) -> float:
    """Start of the UTC day or month containing `now`."""
    day = datetime.fromtimestamp(now, tz=timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    return (day if period == "day" else day.replace(day=1)).timestamp()


def period_end(now: float, period: BudgetPeriod) -> float:
    """End of the UTC day or month containing `now`."""
    if period == "day":
        return period_start(now, period) + 86400.0
    start = datetime.fromtimestamp(period_start(now, period), tz=timezone.utc)
    nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return nxt.timestamp()


class RateLimiter(Protocol):
    """What the gateway calls. Every method is thread-safe; when `blocking` is True the calls do network I/O and
    the gateway runs them in a worker thread (trio.to_thread)."""
    blocking: bool

    def admit(self, request_id: str, scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> Decision:
        """Check every scope and, only if all allow it, reserve `prompt + max_tokens` tokens and a slot in each."""
        ...

    def settle(self, request_id: str, used_tokens: int) -> bool:
        """End of a request on any path: refund `reserved - used` (or charge overuse), free the slot. Idempotent:
        False for an unknown or already settled request (or, for a shared backend, one it could not reach)."""
        ...

    def peek(self, scopes: Sequence[Scope]) -> RateLimitInfo:
        """The x-ratelimit-* values right now, consuming nothing."""
        ...

    def renew(self) -> None:
        """Extend the leases of this process's in-flight reservations (a no-op in process)."""
        ...

    def close(self) -> None:
        ...


@dataclass
class _Bucket:
    level: float
    updated: float

    def refill(self, now: float, capacity: int) -> None:
        elapsed = max(0.0, now - self.updated)  # a wall clock stepping back must not drain anyone
        self.level = min(float(capacity), self.level + elapsed * capacity / WINDOW_S)
        self.updated = now


@dataclass
class _ScopeState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    in_flight: set[str] = field(default_factory=set)
    budget_used: int = 0
    budget_period_end: float = 0.0  # 0: no budget counter yet


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
        denial = _check(scopes, [_levels(st) for st in states], [st.budget_used for st in states],
                        [st.budget_period_end for st in states], [len(st.in_flight) for st in states], cost, now)
        if denial is not None:
            return denial
        for scope, state in zip(scopes, states):
            if state.requests is not None:
                state.requests.level -= 1
            if state.tokens is not None:
                state.tokens.level -= cost
            state.in_flight.add(request_id)
            if _has_budget(scope):
                state.budget_used += cost
        self._reservations[request_id] = _Reservation(
            tuple(scopes), cost,
            {s.name: st.budget_period_end if _has_budget(s) else None for s, st in zip(scopes, states)})
        return Decision(True, info=_info(scopes, [_levels(st) for st in states]))

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
                state = self._refresh_buckets(scope, now)
                if state.tokens is not None and scope.quota.tpm is not None:
                    state.tokens.level = min(float(scope.quota.tpm), state.tokens.level + delta)
                charged = reservation.budget_period_end[scope.name]
                if charged is not None and state.budget_period_end == charged:
                    # A reservation from a period that has since rolled over is not the new period's business.
                    state.budget_used = max(0, state.budget_used - delta)
                state.in_flight.discard(request_id)
            return True

    def peek(self, scopes: Sequence[Scope]) -> RateLimitInfo:
        with self._lock:
            now = self._clock()
            return _info(scopes, [_levels(self._refresh_buckets(s, now)) for s in scopes])

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
            if not _has_budget(scope) or period is None:
                continue
            state = self._states.get(scope.name)
            end = period_end(now, period)
            if (_budget_transition(state.budget_period_end if state else 0.0, end, now) == "seed"
                    and (scope.name, end) not in seeds):
                out[scope.name] = (period_start(now, period), end)
        return out

    def _refresh(self, scope: Scope, now: float, seeds: dict[tuple[str, float], int]) -> _ScopeState:
        state = self._refresh_buckets(scope, now)
        period = scope.quota.budget_period
        if _has_budget(scope) and period is not None:
            end = period_end(now, period)
            transition = _budget_transition(state.budget_period_end, end, now)
            if transition != "keep":
                state.budget_used = 0 if transition == "rollover" else seeds.get((scope.name, end), 0)
                state.budget_period_end = end
        return state

    def _refresh_buckets(self, scope: Scope, now: float) -> _ScopeState:
        q = scope.quota
        state = self._states.setdefault(scope.name, _ScopeState())
        # Buckets start full and follow the current quota (a CLI change applies at the next request).
        if q.rpm is None:
            state.requests = None
        else:
            state.requests = state.requests or _Bucket(float(q.rpm), now)
            state.requests.refill(now, q.rpm)
        if q.tpm is None:
            state.tokens = None
        else:
            state.tokens = state.tokens or _Bucket(float(q.tpm), now)
            state.tokens.refill(now, q.tpm)
        return state


def _has_budget(scope: Scope) -> bool:
    return scope.quota.token_budget is not None and scope.quota.budget_period is not None


def _budget_transition(current_end: float, end: float, now: float) -> Literal["keep", "rollover", "seed"]:
    """How a budget counter whose period ends at `current_end` (0: none yet) enters the period ending at `end`:
    kept, restarted at 0 (the period rolled over while running), or seeded from the ledger (first sight, or the
    quota's period changed)."""
    if current_end == end:
        return "keep"
    return "rollover" if current_end and now >= current_end else "seed"


def _levels(state: _ScopeState) -> tuple[float | None, float | None]:
    return (state.requests.level if state.requests else None, state.tokens.level if state.tokens else None)


def precheck(scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> tuple[int, Decision | None]:
    """What every backend decides before looking at any counter: the reservation's cost, and the 400 for a
    request that can never fit (no round trip, no lock)."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("prompt_tokens and max_tokens must be >= 0")
    never = _never_fits(scopes, prompt_tokens, max_tokens)
    return prompt_tokens + max_tokens, None if never is None else Decision(False, "never_fits", message=never)


def _never_fits(scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> str | None:
    cost = prompt_tokens + max_tokens
    for s in scopes:
        q = s.quota
        if q.max_prompt_tokens is not None and prompt_tokens > q.max_prompt_tokens:
            return f"prompt has {prompt_tokens} tokens; the limit is {q.max_prompt_tokens}"
        if q.max_tokens_per_request is not None and max_tokens > q.max_tokens_per_request:
            return f"max_tokens {max_tokens} exceeds the per-request limit {q.max_tokens_per_request}"
        if q.tpm is not None and cost > q.tpm:
            return f"prompt + max_tokens = {cost} exceeds the tokens-per-minute limit {q.tpm}; lower max_tokens"
        if q.token_budget is not None and cost > q.token_budget:
            return f"prompt + max_tokens = {cost} exceeds the whole token budget {q.token_budget}"
    return None


def _check(scopes: Sequence[Scope], levels: Sequence[tuple[float | None, float | None]],
           budget_used: Sequence[int], budget_period_end: Sequence[float], in_flight: Sequence[int], cost: int,
           now: float) -> Decision | None:
    """The most important denial, or None. Budget beats rate beats concurrency: a budget 429 must not be retried,
    and a rate 429's retry_after is the max over every bucket that is short, so one wait clears them all.
    (tenancy/redis_limiter.py's admit script mirrors this function line by line.)"""
    info = _info(scopes, levels)
    requests_wait: float | None = None
    tokens_wait: float | None = None
    concurrency: int | None = None
    for i, scope in enumerate(scopes):
        q = scope.quota
        requests, tokens = levels[i]
        if _has_budget(scope) and q.token_budget is not None and budget_used[i] + cost > q.token_budget:
            return budget_denial(scope, budget_period_end[i], now, info)
        if q.rpm is not None and requests is not None and requests + _EPS < 1:
            requests_wait = max(requests_wait or 0.0, _wait_for(1, requests, q.rpm))
        if q.tpm is not None and tokens is not None and tokens + _EPS < cost:
            tokens_wait = max(tokens_wait or 0.0, _wait_for(cost, tokens, q.tpm))
        if q.max_concurrent is not None and in_flight[i] >= q.max_concurrent:
            concurrency = i
    if requests_wait is not None or tokens_wait is not None:
        return rate_denial(requests_wait, tokens_wait, info)
    if concurrency is not None:
        return concurrency_denial(scopes[concurrency], in_flight[concurrency], info)
    return None


def _wait_for(need: float, level: float, capacity: int) -> float:
    """Seconds until a bucket of `capacity` per minute at `level` holds `need`."""
    return max(0.0, (need - level) * WINDOW_S / capacity)


def budget_denial(scope: Scope, budget_period_end: float, now: float, info: RateLimitInfo) -> Decision:
    # retry_after here is when the period resets; the 429 says x-should-retry: false regardless.
    q = scope.quota
    return Decision(False, "insufficient_quota", "budget", max(0.0, budget_period_end - now),
                    f"token budget of {q.token_budget} per {q.budget_period} exhausted for {scope.name}", info)


def rate_denial(requests_wait: float | None, tokens_wait: float | None, info: RateLimitInfo) -> Decision:
    wait = max(w for w in (requests_wait, tokens_wait) if w is not None)
    dimension: Literal["requests", "tokens"] = (
        "tokens" if tokens_wait is not None and tokens_wait >= wait else "requests")
    return Decision(False, "rate_limit_exceeded", dimension, wait,
                    f"rate limit reached for {dimension} per minute; retry after {wait:.3f}s", info)


def concurrency_denial(scope: Scope, in_flight: int, info: RateLimitInfo) -> Decision:
    return Decision(False, "concurrency", "concurrency", CONCURRENCY_RETRY_HINT_S,
                    f"{scope.name} already has {in_flight} requests in flight (max {scope.quota.max_concurrent})",
                    info)


def _info(scopes: Sequence[Scope], levels: Sequence[tuple[float | None, float | None]]) -> RateLimitInfo:
    """x-ratelimit-* values from each scope's (requests level, tokens level), from the tightest scope."""
    req: tuple[int, float, float] | None = None  # (limit, level, reset) of the tightest scope
    tok: tuple[int, float, float] | None = None
    for scope, (requests, tokens) in zip(scopes, levels):
        q = scope.quota
        if q.rpm is not None and requests is not None:
            cand = (q.rpm, requests, (q.rpm - requests) * WINDOW_S / q.rpm)
            req = cand if req is None or cand[1] < req[1] else req
        if q.tpm is not None and tokens is not None:
            cand = (q.tpm, tokens, (q.tpm - tokens) * WINDOW_S / q.tpm)
            tok = cand if tok is None or cand[1] < tok[1] else tok
    return RateLimitInfo(
        req[0] if req else None, max(0, math.floor(req[1] + _EPS)) if req else None, req[2] if req else None,
        tok[0] if tok else None, max(0, math.floor(tok[1] + _EPS)) if tok else None, tok[2] if tok else None)
