"""The shared `RateLimiter`: the algorithm of `tenancy.limits_spec` with its state in Redis, so that every gateway
process using one Redis enforces ONE limit (not one per replica).

Each admit and settle is one Lua script (`tenancy.limits_lua`; atomic: it checks every scope and only then consumes
in all of them). Time is the caller's clock, passed in ARGV (never Redis TIME), so gateways on synced hosts agree and
tests can use a fake clock. Quotas come from the caller on every call, so a changed quota applies at the next request.

Key layout (P = key_prefix, S = scope name such as 'tenant:ten_ab12'):
- `P bucket:S`          hash {rl, ru, tl, tu}: requests/tokens bucket level and last update; expires a minute
                        after it would be full again (a missing bucket is a full one).
- `P budget:S:END`      integer: tokens charged to the budget period ending at unix second END; seeded from the
                        ledger (`budget_used(S, period_start)`) when missing; expires an hour after END.
- `P inflight:S`        zset {request id: lease expiry}: concurrency slots; entries whose lease has passed are
                        pruned at admit, so a crashed gateway's slots free themselves after `lease_s`; live gateways
                        call `renew()` (every lease_s / 3 or so). Expires a minute after the last lease.
For Redis Cluster every key of one request must share a slot: use a hash-tagged prefix such as '{kvgate}:'.

Redis unreachable or slow (timeout_s): admit fails closed (`reason='unavailable'`, a 503 with retry-after) or, with
fail_open=True, admits uncounted; for UNAVAILABLE_RETRY_S after a failure admits decide without trying Redis.
settle and renew never raise (they log once per outage, then at debug level): the lease frees the slot, and a
lost refund errs on the safe side. peek answers empty info while Redis is down.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tenancy import limits_lua
from tenancy.limits import BudgetUsed, Decision, RateLimitInfo, Scope
from tenancy.limits_spec import (
    UNAVAILABLE_RETRY_S, budget_denial, budget_ends, concurrency_denial, period_start, precheck, rate_denial,
    rate_limit_info, refill)

log = logging.getLogger("kvgate.tenancy.redis_limiter")

_BUDGET_MARGIN_S = 3600  # a budget counter outlives its period by this much (late settles of that period)
_IDLE_MARGIN_S = 60  # buckets and slot sets outlive the moment they stop mattering by this much (clock skew)
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ReadOnlyError,
                OSError)


@dataclass(frozen=True)
class _Reservation:
    scopes: tuple[Scope, ...]
    tokens: int  # 0 when admitted uncounted (fail-open): settle then charges what was used
    budget_period_end: dict[str, float | None]


class RedisLimiter:
    """`RateLimiter` over a Redis shared by every gateway process. Thread-safe; calls block on the network."""
    blocking: bool = True

    def __init__(self, url_or_client: str | redis.Redis, clock: Callable[[], float],
                 budget_used: BudgetUsed | None = None, *, fail_open: bool = False, key_prefix: str = "kvgate:",
                 lease_s: float = 30.0, timeout_s: float = 0.5, max_connections: int = 64,
                 pool_wait_s: float = 10.0) -> None:
        if lease_s <= 0 or timeout_s <= 0 or pool_wait_s <= 0 or max_connections < 1:
            raise ValueError(f"lease_s, timeout_s, pool_wait_s and max_connections must be > 0, got {lease_s}, "
                             f"{timeout_s}, {pool_wait_s} and {max_connections}")
        if isinstance(url_or_client, str):
            # One quick retry (a pooled connection may be stale after a Redis restart), no backoff: an outage
            # must cost a request at most ~2 x timeout_s, not redis-py's default ten retries.
            # A blocking pool: redis-py's default pool raises "Too many connections" past 100, which a burst
            # of admits would read as an outage (503 for everyone). Waiting for a free connection is not one.
            pool = redis.BlockingConnectionPool.from_url(
                url_or_client, max_connections=max_connections, timeout=pool_wait_s,
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1))
            self._client: redis.Redis = redis.Redis(connection_pool=pool)
            self._client.auto_close_connection_pool = True
            self._owns_client = True
        else:
            self._client = url_or_client
            self._owns_client = False
        self._clock = clock
        self._budget_used = budget_used
        self._fail_open = fail_open
        self._prefix = key_prefix
        self._lease_s = lease_s
        self._admit_script = self._client.register_script(limits_lua.ADMIT)
        self._settle_script = self._client.register_script(limits_lua.SETTLE)
        self._lock = threading.Lock()  # guards the fields below
        self._reservations: dict[str, _Reservation] = {}
        self._pending: set[str] = set()  # ids between the duplicate check and the end of their admit script
        self._down_until: float | None = None  # set during an outage: when to try Redis again

    def admit(self, request_id: str, scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> Decision:
        cost, never = precheck(scopes, prompt_tokens, max_tokens)
        if never is not None:
            return never
        with self._lock:
            if request_id in self._reservations or request_id in self._pending:
                raise ValueError(f"request {request_id!r} already holds a reservation")
            self._pending.add(request_id)
        try:
            now = self._clock()
            if not self._is_down(now):
                try:
                    decision = self._admit_remote(request_id, scopes, cost, now)
                except _UNREACHABLE as e:
                    self._outage(now, f"admit {request_id} for {', '.join(s.name for s in scopes)}", e)
                else:
                    self._recovered()
                    return decision
            if self._fail_open:
                with self._lock:
                    self._reservations[request_id] = _Reservation(tuple(scopes), 0, budget_ends(scopes, now))
                return Decision(True)
            return Decision(False, "unavailable", retry_after=UNAVAILABLE_RETRY_S,
                            message="the rate limiter is unavailable; retry shortly")
        finally:
            with self._lock:
                self._pending.discard(request_id)

    def _admit_remote(self, request_id: str, scopes: Sequence[Scope], cost: int, now: float) -> Decision:
        ends = budget_ends(scopes, now)
        keys = [k for s in scopes for k in self._keys(s, ends[s.name])]
        seeds = {s.name: 0 for s in scopes} if self._budget_used is None else {}
        for _attempt in range(2):
            argv: list[str | int | float] = [repr(now), cost, request_id, repr(self._lease_s), _IDLE_MARGIN_S,
                                             len(scopes)]
            for s in scopes:
                q, end = s.quota, ends[s.name]
                argv += [_opt(q.rpm), _opt(q.tpm), _opt(q.max_concurrent), _opt(q.token_budget),
                         math.ceil(end - now) + _BUDGET_MARGIN_S if end is not None else "",
                         _opt(seeds.get(s.name))]
            reply = [_text(x) for x in self._admit_script(keys=keys, args=argv)]
            if reply[0] != "seed":
                return self._decision(reply, scopes, ends, cost, now, request_id)
            # A budget counter is missing (first sight in this period, or Redis lost it): seed from the ledger;
            # SET NX in the script keeps two gateways seeding at once from double counting.
            for i in reply[1:]:
                scope = scopes[int(i) - 1]
                period = scope.quota.budget_period
                if self._budget_used is None or period is None:  # only budgets without a seed can be missing
                    raise RuntimeError(f"admit script asked for an unexpected budget seed: {reply!r}")
                seeds[scope.name] = self._budget_used(scope.name, period_start(now, period))
                log.info("seeded budget counter of %s from the ledger: %d tokens", scope.name, seeds[scope.name])
        raise RuntimeError("admit script asked for budget seeds twice")

    def _decision(self, reply: list[str], scopes: Sequence[Scope], ends: dict[str, float | None], cost: int,
                  now: float, request_id: str) -> Decision:
        kind = reply[0]
        body = {"ok": 1, "budget": 2, "rate": 3, "concurrency": 3}[kind]
        levels = [(_num(reply[body + 2 * i]), _num(reply[body + 2 * i + 1])) for i in range(len(scopes))]
        info = rate_limit_info(scopes, levels)
        if kind == "budget":
            scope = scopes[int(reply[1]) - 1]
            end = ends[scope.name]
            return budget_denial(scope, end if end is not None else now, now, info)
        if kind == "rate":
            return rate_denial(_num(reply[1]), _num(reply[2]), info)
        if kind == "concurrency":
            return concurrency_denial(scopes[int(reply[1]) - 1], int(reply[2]), info)
        with self._lock:
            self._reservations[request_id] = _Reservation(tuple(scopes), cost, ends)
        return Decision(True, info=info)

    def settle(self, request_id: str, used_tokens: int) -> bool:
        """Refund `reserved - used` (or charge overuse) and free the slot. Idempotent: False for an unknown or
        already settled request, and (logged, never raised) when Redis cannot be reached."""
        if used_tokens < 0:
            raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
        with self._lock:
            reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        now = self._clock()
        current = budget_ends(reservation.scopes, now)
        keys: list[str] = []
        argv: list[str | int | float] = [repr(now), reservation.tokens - used_tokens, request_id, _IDLE_MARGIN_S,
                                         len(reservation.scopes)]
        for s in reservation.scopes:
            charged = reservation.budget_period_end[s.name]
            keys += self._keys(s, charged)
            # A reservation from a period that has since rolled over is not the new period's business.
            argv += [_opt(s.quota.tpm), "1" if charged is not None and charged == current[s.name] else "0"]
        try:
            self._settle_script(keys=keys, args=argv)
        except _UNREACHABLE as e:
            # Tried even during an outage: a refund is worth a try. Lost, the slot frees when its lease ends.
            self._outage(now, f"settle {request_id} ({used_tokens} tokens used)", e)
            return False
        self._recovered()
        return True

    def peek(self, scopes: Sequence[Scope]) -> RateLimitInfo:
        """x-ratelimit-* values now, consuming nothing (empty when Redis cannot be reached)."""
        now = self._clock()
        if self._is_down(now):
            return RateLimitInfo()
        try:
            pipe = self._client.pipeline(transaction=False)
            for s in scopes:
                pipe.hmget(self._keys(s, None)[0], ["rl", "ru", "tl", "tu"])
            rows: list[list[Any]] = pipe.execute()
        except _UNREACHABLE as e:
            self._outage(now, f"peek {', '.join(s.name for s in scopes)}", e)
            return RateLimitInfo()
        self._recovered()
        levels: list[tuple[float | None, float | None]] = []
        for s, row in zip(scopes, rows):
            values = [_num(_text(v)) if v is not None else None for v in row]
            levels.append((_peek_level(values[0], values[1], s.quota.rpm, now),
                           _peek_level(values[2], values[3], s.quota.tpm, now)))
        return rate_limit_info(scopes, levels)

    def renew(self) -> None:
        """Push the lease expiry of this process's in-flight reservations to now + lease_s (call every lease_s / 3
        or so). A slot already settled or pruned is not brought back."""
        with self._lock:
            held = [(rid, r.scopes) for rid, r in self._reservations.items()]
        if not held:
            return
        now = self._clock()
        expiry = now + self._lease_s
        try:
            pipe = self._client.pipeline(transaction=False)
            for rid, scopes in held:
                for s in scopes:
                    pipe.zadd(self._keys(s, None)[2], {rid: expiry}, xx=True)
            for key in {self._keys(s, None)[2] for _, scopes in held for s in scopes}:
                pipe.expire(key, math.ceil(self._lease_s) + _IDLE_MARGIN_S, gt=True)
            pipe.execute()
        except _UNREACHABLE as e:
            self._outage(now, f"renew {len(held)} leases", e)
            return
        self._recovered()

    def in_flight(self, scope: str) -> int:
        """Live slots of a scope across every gateway (expired leases not counted)."""
        key = f"{self._prefix}inflight:{scope}"
        return int(self._client.zcount(key, f"({self._clock()!r}", "+inf"))

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def _keys(self, scope: Scope, budget_end: float | None) -> tuple[str, str, str]:
        p, name = self._prefix, scope.name
        end = f"{budget_end:.0f}" if budget_end is not None else "none"
        return f"{p}bucket:{name}", f"{p}budget:{name}:{end}", f"{p}inflight:{name}"

    def _is_down(self, now: float) -> bool:
        """Within UNAVAILABLE_RETRY_S of the last failure: admit and peek decide without trying Redis."""
        with self._lock:
            return self._down_until is not None and now < self._down_until

    def _outage(self, now: float, what: str, error: BaseException) -> None:
        with self._lock:
            first = self._down_until is None
            self._down_until = now + UNAVAILABLE_RETRY_S
        if first:  # once per outage, not once per request
            log.warning("redis unreachable (%s: %s); failing %s until it is back", what, error,
                        "open: admitting uncounted" if self._fail_open else "closed: 503")
        else:
            log.debug("redis still unreachable: %s failed", what)

    def _recovered(self) -> None:
        with self._lock:
            was_down, self._down_until = self._down_until is not None, None
        if was_down:
            log.warning("redis reachable again; limits enforced")


def _peek_level(level: float | None, updated: float | None, capacity: int | None, now: float) -> float | None:
    if capacity is None:
        return None
    if level is None or updated is None:
        return float(capacity)  # a missing bucket is a full one
    return refill(level, updated, capacity, now)


def _opt(value: int | None) -> str | int:
    return "" if value is None else value


def _num(text: str) -> float | None:
    return None if text == "" else float(text)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
