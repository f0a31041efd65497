"""The two rate-limiter backends implement one algorithm (tenancy/limits_spec.py): random sequences of admit, settle,
peek and clock steps, with quotas that change between calls, run against the in-process `Limiter` and against
`RedisLimiter` on a private redis-server, and every answer must be the same: admit or refuse, the reason and the
dimension, retry_after (to 1e-6 s), the x-ratelimit-* values, settle's result and the in-flight counts.

Both get the same fake clock (the Redis scripts take the time as an argument, never Redis TIME) and the same ledger.
The clock starts near the end of a UTC day so that budget periods roll over. Leases are set far beyond the longest
sequence: lease expiry is the Redis backend's crash recovery, outside the shared algorithm (tests/test_tenancy_redis.py
covers it). Budget periods stay 'day': a scope switched from day to month and back is the one documented difference
(see tenancy/limits_spec.py). database=None: no .hypothesis/ directory is written into the repository.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenancy.limiter import Decision, Limiter, RateLimitInfo, Scope, period_start
from tenancy.models import Quota
from tenancy.redis_limiter import RedisLimiter
from tests.redis_support import RedisServer, redis_server  # noqa: F401  (fixture)

T0 = 1_700_006_400.0  # 2023-11-15 00:00 UTC
START = T0 + 86_400 - 120  # two minutes before the day rolls over
LEASE_S = 1e9  # no lease expires within a sequence (at most 80 steps of an hour)
SCOPE_SETS = (("tenant:a",), ("tenant:a", "key:k"), ("key:k",))
_prefixes = itertools.count()


@dataclass(frozen=True)
class Admit:
    scope_set: int
    variant: int
    prompt: int
    max_tokens: int


@dataclass(frozen=True)
class Settle:
    pick: int  # index into the ids admitted so far (mod their count); past them: an id never admitted
    used: int


@dataclass(frozen=True)
class Advance:
    ms: int


@dataclass(frozen=True)
class Peek:
    scope_set: int
    variant: int


Op = Admit | Settle | Advance | Peek


def _budget(amount: int | None) -> dict[str, object]:
    return {} if amount is None else {"token_budget": amount, "budget_period": "day"}


# Token amounts mostly in round fifties, so that sequences often land exactly on a limit, where off-by-one bugs show.
_round = st.integers(0, 6).map(lambda x: 50 * x)
_tokens = _round | _round | _round | st.integers(0, 300)
_quotas = st.builds(
    lambda rpm, tpm, conc, budget, per_request: Quota(
        rpm=rpm, tpm=tpm, max_concurrent=conc, max_tokens_per_request=per_request,
        **_budget(budget)),  # type: ignore[arg-type]
    st.none() | st.integers(1, 6) | st.integers(1, 6) | st.just(60),
    st.none() | st.integers(1, 30).map(lambda x: 50 * x) | st.integers(30, 1500),
    st.none() | st.integers(1, 3),
    st.none() | st.integers(1, 16).map(lambda x: 50 * x) | st.integers(50, 3000),
    st.none() | st.none() | st.integers(50, 400))
_admits = st.builds(Admit, st.integers(0, len(SCOPE_SETS) - 1), st.integers(0, 1), _tokens, _tokens)
_ops = st.lists(st.one_of(
    _admits, _admits, _admits,
    st.builds(Settle, st.integers(0, 12), _tokens | _tokens.map(lambda x: 2 * x)),
    st.builds(Advance, st.integers(0, 5_000) | st.integers(0, 90_000)
              | st.sampled_from([1, 59_999, 60_000, 600_000, 3_600_000])),
    st.builds(Peek, st.integers(0, len(SCOPE_SETS) - 1), st.integers(0, 1)),
), min_size=20, max_size=80)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:  # noqa: F811
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def _same_info(a: RateLimitInfo, b: RateLimitInfo) -> None:
    assert (a.limit_requests, a.remaining_requests, a.limit_tokens, a.remaining_tokens) == (
        b.limit_requests, b.remaining_requests, b.limit_tokens, b.remaining_tokens)
    for x, y in ((a.reset_requests_s, b.reset_requests_s), (a.reset_tokens_s, b.reset_tokens_s)):
        assert (x is None) == (y is None) and (x is None or y is None or math.isclose(x, y, abs_tol=1e-6))


def _same_decision(a: Decision, b: Decision) -> None:
    assert (a.allowed, a.reason, a.dimension) == (b.allowed, b.reason, b.dimension), (a, b)
    assert (a.retry_after is None) == (b.retry_after is None), (a, b)
    if a.retry_after is not None and b.retry_after is not None:
        assert math.isclose(a.retry_after, b.retry_after, abs_tol=1e-6), (a, b)
    _same_info(a.info, b.info)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tenant=st.tuples(_quotas, _quotas), key=st.tuples(_quotas, _quotas), seeded=st.integers(0, 8).map(lambda x: 50 * x),
       ops=_ops)
def test_both_backends_decide_alike(client: redis.Redis, tenant: tuple[Quota, Quota], key: tuple[Quota, Quota],
                                    seeded: int, ops: list[Op]) -> None:
    quotas = {"tenant:a": tenant, "key:k": key}
    day = period_start(START, "day")

    def ledger(scope: str, since: float) -> int:  # what was used today before the gateways started; 0 tomorrow
        return seeded if since == day else 0

    clock = Clock(START)
    memory = Limiter(clock, ledger)
    shared = RedisLimiter(client, clock, ledger, key_prefix=f"eq{next(_prefixes)}:", lease_s=LEASE_S)
    admitted: list[str] = []
    for n, op in enumerate(ops):
        if isinstance(op, Advance):
            clock.t += op.ms / 1000
            continue
        if isinstance(op, Settle):
            rid = admitted[op.pick % len(admitted)] if admitted and op.pick < 10 else f"unknown{n}"
            assert memory.settle(rid, op.used) == shared.settle(rid, op.used)
        else:
            scopes = [Scope(name, quotas[name][op.variant]) for name in SCOPE_SETS[op.scope_set]]
            if isinstance(op, Peek):
                _same_info(memory.peek(scopes), shared.peek(scopes))
            else:
                a = memory.admit(f"r{n}", scopes, op.prompt, op.max_tokens)
                _same_decision(a, shared.admit(f"r{n}", scopes, op.prompt, op.max_tokens))
                if a.allowed:
                    admitted.append(f"r{n}")
        for name in quotas:
            assert memory.in_flight(name) == shared.in_flight(name)


def test_no_private_imports_between_tenancy_modules() -> None:
    """The backends share the specification's public names only: no `from tenancy.x import _name`."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted((Path(__file__).parent.parent / "tenancy").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tenancy"):
                offenders += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []
