"""The rate-limit algorithm, written down once. Both backends implement exactly this: `tenancy.limiter.Limiter` by
calling these functions, `tenancy.redis_limiter.RedisLimiter` in Lua (`tenancy.limits_lua`, whose steps carry the
names of the functions here). tests/test_limits_equivalence.py runs random operation sequences against both and
requires the same decisions.

State per scope (a counter namespace such as 'tenant:ten_ab12', with the quota the caller passes on every call, so
a changed quota applies at the next request):
- a requests bucket (when the quota has rpm) and a tokens bucket (when it has tpm): the level it was left at and
  when, written only when an admit consumes or a settle refunds (reads compute, never store). Its level at any time
  is `refill`: C / WINDOW_S per second for capacity C, never above the current C; a bucket never written, or
  forgotten, is full; a clock stepping back refills nothing. A bucket whose limit is lifted keeps what it was left
  at, should the limit return.
- a budget counter (when it has token_budget and budget_period): tokens charged to the current UTC day or month.
- the set of request ids in flight (concurrency slots).

admit(request, scopes, prompt, max_tokens), cost = prompt + max_tokens:
1. `precheck`: a request that can never fit (prompt over max_prompt_tokens, max_tokens over max_tokens_per_request,
   cost over tpm or over the whole budget) is a `never_fits` 400, decided before any counter is read.
2. Budget counters enter the current period (`budget_transition`): kept; restarted at 0 when the period rolled over
   while running ('rollover'); or seeded from the ledger, `budget_used(scope, period_start)`, on first sight or when
   the quota's period changed ('seed'). (Redis keys its counters by period, so a rollover there is a first sight
   whose ledger answer is what the new period holds so far; 0 for a period that just started.)
3. `check`, over every scope, the most important denial first: a budget that cost would overrun is
   `insufficient_quota` (retry_after: the end of the period; never to be retried); else any bucket short of what it
   needs (1 request, cost tokens; EPS of float slack) is `rate_limit_exceeded`, with retry_after the longest
   `wait_for` over every short bucket, so one wait clears them all; else a scope whose slots are all taken is
   `concurrency` (retry_after a hint: a slot frees when another request ends).
4. Allowed only if no scope denies: then, in every scope, 1 request and cost tokens leave the buckets, cost is added
   to the budget counter and a slot is taken. All or nothing, atomically.
5. Either way the decision carries `rate_limit_info` (x-ratelimit-* from the tightest scope) of the levels it saw
   (after the consumption, when allowed).

settle(request, used), delta = reserved - used: once per request (idempotent: a second settle does nothing):
6. every scope's tokens bucket gets delta back, capped at its capacity (`settled_tokens`; a negative delta, overuse,
   is debt); its budget counter gives back delta, not below 0 (`settled_budget`), only if the reservation's period is
   still the current one; its slot is freed.

peek(scopes): `rate_limit_info` of the levels now, consuming nothing.

The one known difference: a scope whose budget period is switched (day to month) and back again, within one
period, resumes in Redis the counter it left there, while in process it is seeded from the ledger again.

What only one backend has: Redis slots are leases (lease_s, renewed by the live gateway) so a crashed gateway's
slots free themselves; Redis keys expire once they stop mattering; a Redis outage fails closed (503) or open.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from tenancy.limits import Decision, RateLimitInfo, Scope
from tenancy.models import BudgetPeriod

WINDOW_S = 60.0  # a bucket refills its whole capacity in this long
EPS = 1e-6  # float slack so that waiting exactly `retry_after` is always enough
CONCURRENCY_RETRY_HINT_S = 1.0  # a slot frees when some other request ends: unknowable, so only a hint
UNAVAILABLE_RETRY_S = 1.0  # the shared backend is down: retry soon (and a gateway skips it for this long)

Levels = tuple[float | None, float | None]  # (requests, tokens) bucket levels of one scope; None where unlimited
Transition = Literal["keep", "rollover", "seed"]


@dataclass(frozen=True)
class Counters:
    """One scope's state as `check` sees it."""
    levels: Levels
    budget_used: int = 0
    budget_period_end: float = 0.0
    in_flight: int = 0


def refill(level: float | None, updated: float, capacity: int, now: float) -> float:
    """A bucket's level at `now`: full when unknown, never above capacity, never drained by a clock stepping back."""
    if level is None:
        return float(capacity)
    return min(float(capacity), level + max(0.0, now - updated) * capacity / WINDOW_S)


def wait_for(need: float, level: float, capacity: int) -> float:
    """Seconds until a bucket of `capacity` per minute at `level` holds `need`."""
    return max(0.0, (need - level) * WINDOW_S / capacity)


def settled_tokens(level: float, delta: int, capacity: int) -> float:
    return min(float(capacity), level + delta)


def settled_budget(used: int, delta: int) -> int:
    return max(0, used - delta)


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


def has_budget(scope: Scope) -> bool:
    return scope.quota.token_budget is not None and scope.quota.budget_period is not None


def budget_ends(scopes: Sequence[Scope], now: float) -> dict[str, float | None]:
    """{scope name: end of its current budget period}, None where it has no budget."""
    return {s.name: period_end(now, s.quota.budget_period)
            if has_budget(s) and s.quota.budget_period is not None else None for s in scopes}


def budget_transition(current_end: float, end: float, now: float) -> Transition:
    """How a budget counter whose period ends at `current_end` (0: none yet) enters the period ending at `end`."""
    if current_end == end:
        return "keep"
    return "rollover" if current_end and now >= current_end else "seed"


def precheck(scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> tuple[int, Decision | None]:
    """Step 1: the reservation's cost, and the 400 for a request that can never fit (no counter read)."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("prompt_tokens and max_tokens must be >= 0")
    never = never_fits(scopes, prompt_tokens, max_tokens)
    return prompt_tokens + max_tokens, None if never is None else Decision(False, "never_fits", message=never)


def never_fits(scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> str | None:
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


def check(scopes: Sequence[Scope], counters: Sequence[Counters], cost: int, now: float) -> Decision | None:
    """Step 3: the most important denial, or None (admit)."""
    info = rate_limit_info(scopes, [c.levels for c in counters])
    requests_wait: float | None = None
    tokens_wait: float | None = None
    concurrency: int | None = None
    for i, (scope, c) in enumerate(zip(scopes, counters)):
        q = scope.quota
        requests, tokens = c.levels
        if has_budget(scope) and q.token_budget is not None and c.budget_used + cost > q.token_budget:
            return budget_denial(scope, c.budget_period_end, now, info)
        if q.rpm is not None and requests is not None and requests + EPS < 1:
            requests_wait = max(requests_wait or 0.0, wait_for(1, requests, q.rpm))
        if q.tpm is not None and tokens is not None and tokens + EPS < cost:
            tokens_wait = max(tokens_wait or 0.0, wait_for(cost, tokens, q.tpm))
        if q.max_concurrent is not None and c.in_flight >= q.max_concurrent:
            concurrency = i
    if requests_wait is not None or tokens_wait is not None:
        return rate_denial(requests_wait, tokens_wait, info)
    if concurrency is not None:
        return concurrency_denial(scopes[concurrency], counters[concurrency].in_flight, info)
    return None


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


def rate_limit_info(scopes: Sequence[Scope], levels: Sequence[Levels]) -> RateLimitInfo:
    """Step 5: x-ratelimit-* values from each scope's (requests, tokens) levels, from the tightest scope."""
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
        req[0] if req else None, max(0, math.floor(req[1] + EPS)) if req else None, req[2] if req else None,
        tok[0] if tok else None, max(0, math.floor(tok[1] + EPS)) if tok else None, tok[2] if tok else None)

