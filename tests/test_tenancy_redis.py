"""tenancy.redis_limiter beyond the scenarios it shares with the in-process limiter (tests/test_tenancy_limiter.py):
several gateways on one Redis enforce one limit, leases free a dead gateway's slots, and outages fail closed or
open and recover. A private redis-server per module (tests/redis_support.py); a fake clock throughout."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from tenancy.limiter import BudgetUsed, RateLimitInfo, Scope
from tenancy.models import Quota
from tenancy.redis_limiter import RedisLimiter
from tests.redis_support import RedisServer, redis_server, redis_url  # noqa: F401  (fixtures)
from tests.test_tenancy_limiter import T0, FakeClock, FakeLedger, _tenant

_prefixes = itertools.count()
MakeRedisLimiter = Callable[..., RedisLimiter]


@pytest.fixture
def make(redis_url: str) -> Iterator[MakeRedisLimiter]:  # noqa: F811
    """make(clock, budget_used=None, prefix=None, **kw): a RedisLimiter; limiters made with the same prefix
    are gateways sharing state, a new prefix per call otherwise."""
    made: list[RedisLimiter] = []

    def factory(clock: Callable[[], float], budget_used: BudgetUsed | None = None, prefix: str | None = None,
                **kw: object) -> RedisLimiter:
        limiter = RedisLimiter(redis_url, clock, budget_used, key_prefix=prefix or f"r{next(_prefixes)}:",
                               **kw)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    yield factory
    for limiter in made:
        limiter.close()


def test_two_gateways_on_one_redis_enforce_one_limit(make: MakeRedisLimiter) -> None:
    clock = FakeClock()
    gateways = [make(clock, prefix="shared:"), make(clock, prefix="shared:")]
    scopes = _tenant(tpm=10_000)
    start = threading.Barrier(200)

    def one(i: int) -> tuple[bool, int]:
        start.wait()
        cost = 30 + i % 7 + 64
        return gateways[i % 2].admit(f"r{i}", scopes, prompt_tokens=30 + i % 7, max_tokens=64).allowed, cost

    with ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(one, range(200)))
    admitted = sum(cost for ok, cost in results if ok)
    assert 10_000 - 100 < admitted <= 10_000  # one bucket of 10k, not two
    assert {i % 2 for i, (ok, _) in enumerate(results) if ok} == {0, 1}  # both gateways admitted some
    remaining = [g.peek(scopes).remaining_tokens for g in gateways]
    assert remaining[0] == remaining[1] == 10_000 - admitted


def test_concurrency_is_shared_and_a_dead_gateways_slot_frees_after_its_lease(make: MakeRedisLimiter) -> None:
    clock = FakeClock()
    dead, live, other = (make(clock, prefix="shared:", lease_s=30.0) for _ in range(3))
    scopes = _tenant(max_concurrent=1)
    assert dead.admit("crashed", scopes, 1, 1).allowed  # this gateway never settles
    assert other.admit("x", scopes, 1, 1).reason == "concurrency"
    assert other.in_flight("tenant:a") == 1
    clock.t += 29.9
    assert not other.admit("x", scopes, 1, 1).allowed
    clock.t += 0.1  # the lease ran out: the slot frees itself
    assert other.in_flight("tenant:a") == 0
    assert other.admit("x", scopes, 1, 1).allowed
    assert other.settle("x", 2)
    # a live gateway renews: its slot outlives the lease
    assert live.admit("long", scopes, 1, 1).allowed
    for _ in range(4):
        clock.t += 20
        live.renew()
    assert other.admit("y", scopes, 1, 1).reason == "concurrency"
    assert live.settle("long", 2)
    assert other.admit("y", scopes, 1, 1).allowed


def test_fail_closed_is_a_503_and_recovers(make: MakeRedisLimiter, redis_server: RedisServer,  # noqa: F811
                                           caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    limiter = make(clock)
    scopes = _tenant(tpm=1000, max_concurrent=5)
    assert limiter.admit("before", scopes, 100, 100).allowed
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvgate.tenancy.redis_limiter"):
        for i in range(3):
            clock.t += 2 if i else 0  # past the pause between tries: each of these admits tries Redis again
            d = limiter.admit(f"r{i}", scopes, 1, 1)
            assert (d.allowed, d.reason, d.http_status) == (False, "unavailable", 503)
            assert d.headers()["retry-after"] == "1"
        assert limiter.settle("before", 10) is False  # logged, never raised
        assert limiter.settle("before", 10) is False  # and forgotten: not retried
        limiter.renew()
        assert limiter.peek(scopes) == RateLimitInfo()
    outage_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage_logs) == 1 and "r0" in outage_logs[0].getMessage()  # once per outage, not per request
    redis_server.start()  # back, and empty
    assert limiter.admit("r9", scopes, 1, 1).reason == "unavailable"  # within the pause after the last failure
    clock.t += 1
    d = limiter.admit("r9", scopes, 100, 100)
    assert d.allowed and d.info.remaining_tokens == 800
    assert limiter.settle("r9", 100)


def test_fail_open_admits_uncounted_and_charges_usage_when_back(make: MakeRedisLimiter,
                                                                 redis_server: RedisServer) -> None:  # noqa: F811
    clock = FakeClock()
    limiter = make(clock, fail_open=True)
    scopes = _tenant(tpm=1000)
    redis_server.stop()
    d = limiter.admit("a", scopes, 100, 2000)  # 2100 > tpm is still never_fits: decided without Redis
    assert d.reason == "never_fits"
    d = limiter.admit("a", scopes, 100, 500)
    assert d.allowed and d.info == RateLimitInfo()
    redis_server.start()
    assert limiter.settle("a", 300)  # nothing was reserved: the whole use is charged
    assert limiter.peek(scopes).remaining_tokens == 700


def test_a_hung_redis_times_out_fast(make: MakeRedisLimiter, redis_server: RedisServer) -> None:  # noqa: F811
    clock = FakeClock()
    limiter = make(clock, timeout_s=0.2)
    assert limiter.admit("a", _tenant(rpm=10), 1, 1).allowed
    redis_server.pause()
    try:
        started = time.monotonic()
        d = limiter.admit("b", _tenant(rpm=10), 1, 1)
        elapsed = time.monotonic() - started
    finally:
        redis_server.resume()
    assert d.reason == "unavailable"
    assert elapsed < 1.5  # one try and one retry of 0.2 s, not redis-py's default of ten with backoff


def test_simultaneous_seeding_does_not_double_count(make: MakeRedisLimiter, redis_url: str) -> None:  # noqa: F811
    clock = FakeClock(T0 + 60)
    scopes = _tenant(token_budget=2000, budget_period="day")
    first = make(clock, FakeLedger({T0: 500}), prefix="shared:")

    def slow_ledger(scope: str, since: float) -> int:
        # while this gateway asks the ledger, another one seeds the counter and admits
        assert first.admit("first", scopes, 100, 100).allowed
        return 500

    second = make(clock, slow_ledger, prefix="shared:")
    assert second.admit("second", scopes, 100, 100).allowed
    client = redis.Redis.from_url(redis_url)
    try:
        [key] = client.keys("shared:budget:*")
        assert client.get(key) == b"900"  # 500 seeded once (SET NX), not twice, + 200 + 200
        assert 86400 < client.ttl(key) <= 86400 + 3600  # expires a bit after the period ends
    finally:
        client.close()
    assert not second.admit("third", scopes, 500, 601).allowed
    assert second.admit("third", scopes, 500, 600).allowed


def test_budget_is_reseeded_after_redis_loses_it(make: MakeRedisLimiter,
                                                 redis_server: RedisServer) -> None:  # noqa: F811
    clock = FakeClock(T0 + 60)
    ledger = FakeLedger({T0: 300})
    limiter = make(clock, ledger)
    scopes = _tenant(token_budget=1000, budget_period="day")
    assert limiter.admit("a", scopes, 100, 100).allowed
    redis_server.stop()
    redis_server.start()  # no persistence: every counter is gone
    clock.t += 1
    ledger.used_since[T0] = 800  # what the ledger holds by now
    assert not limiter.admit("b", scopes, 100, 101).allowed
    assert limiter.admit("b", scopes, 100, 100).allowed
    assert ledger.calls == [("tenant:a", T0), ("tenant:a", T0)]


def test_every_key_expires(make: MakeRedisLimiter, redis_url: str) -> None:  # noqa: F811
    clock = FakeClock()
    limiter = make(clock, FakeLedger({}), prefix="ttl:")
    scopes = [Scope("tenant:a", Quota(rpm=60, tpm=6000, max_concurrent=2, token_budget=10**6, budget_period="day")),
              Scope("key:k", Quota())]
    assert limiter.admit("a", scopes, 100, 100).allowed
    assert limiter.admit("b", scopes, 100, 100).allowed
    limiter.settle("a", 50)
    client = redis.Redis.from_url(redis_url)
    try:
        keys = sorted(k.decode() if isinstance(k, bytes) else k for k in client.keys("ttl:*"))
        assert keys == ["ttl:bucket:tenant:a", f"ttl:budget:tenant:a:{T0 + 86400:.0f}", "ttl:inflight:key:k",
                        "ttl:inflight:tenant:a"]
        assert all(client.ttl(k) > 0 for k in keys)
        assert client.ttl("ttl:bucket:tenant:a") <= 60 + 60  # full again within a minute, plus the margin
    finally:
        client.close()


def test_more_callers_than_pooled_connections_wait_instead_of_failing(make: MakeRedisLimiter) -> None:
    # redis-py's default pool raises "Too many connections" once full; read as an outage that would 503 the
    # burst (it did in CI with 200 threads). A full pool must make callers wait for a connection.
    limiter = make(FakeClock(), max_connections=2)
    scopes = _tenant(rpm=1_000)
    start = threading.Barrier(40)

    def one(i: int) -> bool:
        start.wait()
        return limiter.admit(f"r{i}", scopes, prompt_tokens=1, max_tokens=1).allowed

    with ThreadPoolExecutor(max_workers=40) as pool:
        assert all(pool.map(one, range(40)))
    assert limiter.peek(scopes).remaining_requests == 1_000 - 40
