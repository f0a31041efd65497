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
The clock is wall time (seconds since the epoch) because budget periods are calendar periods.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal

from tenancy.models import BudgetPeriod, Quota

WINDOW_S = 60.0
_EPS = 1e-6  # float slack so that waiting exactly `retry_after` is always enough
CONCURRENCY_RETRY_HINT_S = 1.0  # a slot frees when some other request ends: unknowable, so only a hint

DenyReason = Literal["rate_limit_exceeded", "concurrency", "insufficient_quota", "never_fits"]


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
    dimension: Literal["requests", "tokens", "budget", "concurrency"] | None = None
    retry_after: float | None = None  # seconds; accurate for rpm/tpm denials
    message: str = ""
    info: RateLimitInfo = field(default_factory=RateLimitInfo)

    @property
    def http_status(self) -> int:
        if self.allowed:
            return 200
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


def period_end(now: float, period: BudgetPeriod) -> float:
    """End of the UTC day or month containing `now`."""
    t = datetime.fromtimestamp(now, tz=timezone.utc)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return start.timestamp() + 86400.0
    start = start.replace(day=1)
    nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return nxt.timestamp()


@dataclass
class _Bucket:
    level: float
    updated: float

    def refill(self, now: float, capacity: int) -> None:
        elapsed = max(0.0, now - self.updated)  # a wall clock stepping back must not drain anyone
        self.level = min(float(capacity), self.level + elapsed * capacity / WINDOW_S)
        self.updated = now

    def wait_for(self, need: float, capacity: int) -> float:
        return max(0.0, (need - self.level) * WINDOW_S / capacity)


@dataclass
class _ScopeState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    in_flight: set[str] = field(default_factory=set)
    budget_used: int = 0
    budget_period_end: float = 0.0


@dataclass(frozen=True)
class _Reservation:
    scopes: tuple[Scope, ...]
    tokens: int
    budget_period_end: dict[str, float]


class Limiter:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the gateway may call from threads; decisions must be atomic
        self._states: dict[str, _ScopeState] = {}
        self._reservations: dict[str, _Reservation] = {}

    def seed_budget(self, scope: str, used_tokens: int) -> None:
        """Start a scope's current-period budget counter from the ledger (called at gateway start)."""
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        with self._lock:
            self._states.setdefault(scope, _ScopeState()).budget_used = used_tokens

    def in_flight(self, scope: str) -> int:
        with self._lock:
            state = self._states.get(scope)
            return len(state.in_flight) if state else 0

    def admit(self, request_id: str, scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> Decision:
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("prompt_tokens and max_tokens must be >= 0")
        cost = prompt_tokens + max_tokens
        never = _never_fits(scopes, prompt_tokens, max_tokens)
        if never is not None:
            return Decision(False, "never_fits", message=never)
        with self._lock:
            if request_id in self._reservations:
                raise ValueError(f"request {request_id!r} already holds a reservation")
            now = self._clock()
            states = [self._refresh(s, now) for s in scopes]
            denial = _check(scopes, states, cost, now)
            if denial is not None:
                return Decision(False, denial[0], denial[1], denial[2], denial[3], _info(scopes, states))
            for scope, state in zip(scopes, states):
                if state.requests is not None:
                    state.requests.level -= 1
                if state.tokens is not None:
                    state.tokens.level -= cost
                state.in_flight.add(request_id)
                state.budget_used += cost
            self._reservations[request_id] = _Reservation(
                tuple(scopes), cost, {s.name: st.budget_period_end for s, st in zip(scopes, states)})
            return Decision(True, info=_info(scopes, states))

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
                state = self._refresh(scope, now)
                if state.tokens is not None and scope.quota.tpm is not None:
                    state.tokens.level = min(float(scope.quota.tpm), state.tokens.level + delta)
                if state.budget_period_end == reservation.budget_period_end[scope.name]:
                    # A reservation from a period that has since rolled over is not the new period's business.
                    state.budget_used = max(0, state.budget_used - delta)
                state.in_flight.discard(request_id)
            return True

    def _refresh(self, scope: Scope, now: float) -> _ScopeState:
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
        if q.budget_period is not None:
            if now >= state.budget_period_end:
                if state.budget_period_end:  # not the first sight of this scope: a new period starts empty
                    state.budget_used = 0
                state.budget_period_end = period_end(now, q.budget_period)
        return state


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


def _check(scopes: Sequence[Scope], states: Sequence[_ScopeState], cost: int, now: float
           ) -> tuple[DenyReason, Literal["requests", "tokens", "budget", "concurrency"], float | None, str] | None:
    """The most important denial, or None. Budget beats rate beats concurrency: a budget 429 must not be retried,
    and a rate 429's retry_after is the max over every bucket that is short, so one wait clears them all."""
    rate_wait: dict[str, float] = {}
    concurrency = None
    for scope, state in zip(scopes, states):
        q = scope.quota
        if q.token_budget is not None and state.budget_used + cost > q.token_budget:
            # retry_after here is when the period resets; the 429 says x-should-retry: false regardless.
            return ("insufficient_quota", "budget", max(0.0, state.budget_period_end - now),
                    f"token budget of {q.token_budget} per {q.budget_period} exhausted for {scope.name}")
        if q.rpm is not None and state.requests is not None and state.requests.level + _EPS < 1:
            rate_wait["requests"] = max(rate_wait.get("requests", 0.0), state.requests.wait_for(1, q.rpm))
        if q.tpm is not None and state.tokens is not None and state.tokens.level + _EPS < cost:
            rate_wait["tokens"] = max(rate_wait.get("tokens", 0.0), state.tokens.wait_for(cost, q.tpm))
        if q.max_concurrent is not None and len(state.in_flight) >= q.max_concurrent:
            concurrency = f"{scope.name} already has {len(state.in_flight)} requests in flight (max {q.max_concurrent})"
    if rate_wait:
        wait = max(rate_wait.values())
        dimension: Literal["requests", "tokens"] = "tokens" if rate_wait.get("tokens", -1.0) >= wait else "requests"
        return ("rate_limit_exceeded", dimension, wait,
                f"rate limit reached for {dimension} per minute; retry after {wait:.3f}s")
    if concurrency is not None:
        return ("concurrency", "concurrency", CONCURRENCY_RETRY_HINT_S, concurrency)
    return None


def _info(scopes: Sequence[Scope], states: Sequence[_ScopeState]) -> RateLimitInfo:
    req: tuple[int, float, float] | None = None  # (limit, level, reset) of the tightest scope
    tok: tuple[int, float, float] | None = None
    for scope, state in zip(scopes, states):
        q = scope.quota
        if q.rpm is not None and state.requests is not None:
            cand = (q.rpm, state.requests.level, (q.rpm - state.requests.level) * WINDOW_S / q.rpm)
            req = cand if req is None or cand[1] < req[1] else req
        if q.tpm is not None and state.tokens is not None:
            cand = (q.tpm, state.tokens.level, (q.tpm - state.tokens.level) * WINDOW_S / q.tpm)
            tok = cand if tok is None or cand[1] < tok[1] else tok
    return RateLimitInfo(
        req[0] if req else None, max(0, math.floor(req[1] + _EPS)) if req else None, req[2] if req else None,
        tok[0] if tok else None, max(0, math.floor(tok[1] + _EPS)) if tok else None, tok[2] if tok else None)
