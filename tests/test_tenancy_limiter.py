"""tenancy.limiter: reserve/settle token buckets, concurrency slots, budgets and never-fits (fake clock).

Every scenario that takes `make_limiter` runs against both backends: the in-process `Limiter` and `RedisLimiter` on
a private redis-server (skipped without one, unless KVGATE_REQUIRE_REDIS=1)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import pytest

from tenancy.limiter import (
    BudgetUsed, Decision, Limiter, RateLimiter, RateLimitInfo, Scope, format_duration, period_end, period_start)
from tenancy.models import Quota
from tenancy.redis_limiter import RedisLimiter
from tests.redis_support import redis_server, redis_url  # noqa: F401  (fixtures)

T0 = 1_700_006_400.0  # 2023-11-15 00:00 UTC


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _tenant(**quota: object) -> list[Scope]:
    return [Scope("tenant:a", Quota(**quota))]  # type: ignore[arg-type]


AnyLimiter = Limiter | RedisLimiter
MakeLimiter = Callable[..., AnyLimiter]  # (clock, budget_used=None) -> a fresh limiter with its own state
_prefixes = itertools.count()


@pytest.fixture(params=["memory", "redis"])
def make_limiter(request: pytest.FixtureRequest) -> Iterator[MakeLimiter]:
    url: str | None = request.getfixturevalue("redis_url") if request.param == "redis" else None
    made: list[AnyLimiter] = []

    def make(clock: Callable[[], float], budget_used: BudgetUsed | None = None) -> AnyLimiter:
        limiter: AnyLimiter = (Limiter(clock, budget_used) if url is None else
                               RedisLimiter(url, clock, budget_used, key_prefix=f"t{next(_prefixes)}:"))
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        limiter.close()


class FakeLedger:
    """`budget_used` that records its calls and answers from a table {since: tokens} (0 when not listed)."""
    def __init__(self, used_since: dict[float, int]) -> None:
        self.used_since = used_since
        self.calls: list[tuple[str, float]] = []

    def __call__(self, scope: str, since: float) -> int:
        self.calls.append((scope, since))
        return self.used_since.get(since, 0)


def test_burst_of_200_threads_never_admits_more_tokens_than_tpm(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(tpm=10_000)
    start = threading.Barrier(200)

    def one(i: int) -> tuple[bool, int]:
        start.wait()
        d = limiter.admit(f"r{i}", scopes, prompt_tokens=30 + i % 7, max_tokens=64)
        return d.allowed, 30 + i % 7 + 64

    with ThreadPoolExecutor(max_workers=200) as pool:
        results = list(pool.map(one, range(200)))
    admitted = sum(cost for ok, cost in results if ok)
    assert 0 < admitted <= 10_000
    assert admitted > 10_000 - 100  # and the bucket was actually used up, not refused early
    assert sum(ok for ok, _ in results) < 200


def test_denied_requests_carry_accurate_retry_after(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(tpm=600)  # refills 10 tokens/s
    assert limiter.admit("a", scopes, 100, 400).allowed
    denied = limiter.admit("b", scopes, 100, 100)
    assert (denied.allowed, denied.reason, denied.dimension, denied.http_status) == (
        False, "rate_limit_exceeded", "tokens", 429)
    assert denied.retry_after == pytest.approx(10.0)  # needs 200, has 100, 10/s
    assert denied.headers()["retry-after"] == "10"
    clock.t += denied.retry_after * 0.99  # type: ignore[operator]
    assert not limiter.admit("b", scopes, 100, 100).allowed
    clock.t = T0 + denied.retry_after  # type: ignore[operator]
    assert limiter.admit("b", scopes, 100, 100).allowed


def test_retry_after_is_the_max_over_short_buckets(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = [Scope("tenant:a", Quota(rpm=2, tpm=600)), Scope("key:k", Quota(rpm=1))]
    assert limiter.admit("a", scopes, 10, 10).allowed
    d = limiter.admit("b", scopes, 10, 10)
    assert d.reason == "rate_limit_exceeded" and d.dimension == "requests"
    assert d.retry_after == pytest.approx(60.0)  # the key scope's 1 rpm, not the tenant's 2 rpm
    clock.t += d.retry_after  # type: ignore[operator]
    assert limiter.admit("b", scopes, 10, 10).allowed


def test_settle_refunds_unused_reservation_and_is_idempotent(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(tpm=1000)
    assert limiter.admit("a", scopes, 100, 800).allowed
    assert not limiter.admit("b", scopes, 100, 100).allowed
    assert limiter.settle("a", used_tokens=150) is True  # 750 of the 900 reserved come back
    assert limiter.settle("a", used_tokens=150) is False
    assert limiter.settle("never-admitted", 0) is False
    d = limiter.admit("b", scopes, 100, 100)
    assert d.allowed and d.info.remaining_tokens == 1000 - 150 - 200


def test_settle_charges_overuse_as_debt(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(tpm=600)
    assert limiter.admit("a", scopes, 10, 10).allowed
    limiter.settle("a", used_tokens=620)  # reserved 20, used 620: the bucket goes 20 below empty
    d = limiter.admit("b", scopes, 10, 10)
    assert d.retry_after == pytest.approx(4.0)  # from -20 to 20 at 10/s


def test_concurrency_slots_are_released_on_every_path(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(max_concurrent=2)
    for end_path_used_tokens in (5, 0, 3):  # completion, error before any token, cancel mid-stream
        assert limiter.admit("x", scopes, 1, 1).allowed
        assert limiter.admit("y", scopes, 1, 1).allowed
        d = limiter.admit("z", scopes, 1, 1)
        assert (d.allowed, d.reason, d.http_status) == (False, "concurrency", 429)
        assert limiter.in_flight("tenant:a") == 2
        limiter.settle("x", end_path_used_tokens)
        limiter.settle("x", end_path_used_tokens)  # a second path (e.g. worker death after cancel) is a no-op
        limiter.settle("y", end_path_used_tokens)
        assert limiter.in_flight("tenant:a") == 0


def test_duplicate_request_id_is_an_error(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(FakeClock())
    assert limiter.admit("a", _tenant(), 1, 1).allowed
    with pytest.raises(ValueError, match="already"):
        limiter.admit("a", _tenant(), 1, 1)
    with pytest.raises(ValueError):
        limiter.admit("b", _tenant(), -1, 1)


@pytest.mark.parametrize("quota, prompt, max_tokens, fragment", [
    (dict(tpm=1000), 600, 401, "tokens-per-minute"),
    (dict(max_tokens_per_request=256), 10, 257, "per-request"),
    (dict(max_prompt_tokens=100), 101, 1, "prompt"),
    (dict(token_budget=500, budget_period="day"), 400, 101, "budget"),
])
def test_never_fits_is_a_400_not_a_429(make_limiter: MakeLimiter, quota: dict[str, object], prompt: int,
                                       max_tokens: int, fragment: str) -> None:
    limiter = make_limiter(FakeClock())
    d = limiter.admit("a", _tenant(**quota), prompt, max_tokens)
    assert (d.allowed, d.reason, d.http_status, d.retry_after) == (False, "never_fits", 400, None)
    assert fragment in d.message
    assert limiter.in_flight("tenant:a") == 0


def test_budget_exhaustion_is_insufficient_quota_and_resets_next_period(make_limiter: MakeLimiter) -> None:
    clock = FakeClock(T0 + 3600)
    ledger = FakeLedger({T0: 700})  # the ledger says 700 were used today before this gateway started
    limiter = make_limiter(clock, ledger)
    scopes = _tenant(token_budget=1000, budget_period="day")
    assert limiter.admit("a", scopes, 100, 200).allowed  # reserves up to exactly 1000
    assert ledger.calls == [("tenant:a", T0)]
    d = limiter.admit("b", scopes, 1, 1)
    assert (d.reason, d.http_status) == ("insufficient_quota", 429)
    assert d.headers()["x-should-retry"] == "false" and "retry-after" not in d.headers()
    assert d.retry_after == pytest.approx(86400 - 3600)
    limiter.settle("a", 50)  # refund 250 of the reservation
    assert limiter.admit("b", scopes, 100, 150).allowed
    assert not limiter.admit("c", scopes, 1, 1).allowed
    clock.t = T0 + 86400  # next UTC day
    assert limiter.admit("c", scopes, 400, 500).allowed
    limiter.settle("b", 250)  # settling a reservation from yesterday leaves today's counter alone
    assert not limiter.admit("d", scopes, 50, 51).allowed
    assert limiter.admit("d", scopes, 50, 50).allowed


def test_ratelimit_headers(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = _tenant(rpm=60, tpm=6000)
    d = limiter.admit("a", scopes, 100, 500)
    assert d.headers() == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "5400",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert Decision(True).headers() == {}  # unlimited tenant: no rate-limit headers


def test_quota_change_applies_to_existing_bucket(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    assert limiter.admit("a", _tenant(tpm=1000), 100, 100).allowed
    limiter.settle("a", 200)
    d = limiter.admit("b", _tenant(tpm=500), 100, 100)  # lowered by the CLI: level is clamped to the new cap
    assert d.allowed and d.info.remaining_tokens == 300


def test_format_duration_and_period_end() -> None:
    assert [format_duration(s) for s in (None, 0.02, 1.0, 1.5, 360.0)] == ["0s", "20ms", "1s", "1.5s", "6m0s"]
    assert period_end(T0 + 5, "day") == T0 + 86400
    dec = datetime(2023, 12, 31, 23, tzinfo=timezone.utc).timestamp()
    assert period_end(dec, "month") == datetime(2024, 1, 1, tzinfo=timezone.utc).timestamp()
    assert period_start(T0 + 86399, "day") == T0
    assert period_start(dec, "month") == datetime(2023, 12, 1, tzinfo=timezone.utc).timestamp()
    assert period_end(period_start(dec, "month"), "month") == period_end(dec, "month")


def test_budget_is_seeded_once_per_scope_and_period_from_the_ledger(make_limiter: MakeLimiter) -> None:
    clock = FakeClock(T0 + 60)
    ledger = FakeLedger({T0: 900})
    limiter = make_limiter(clock, ledger)
    tenant = Scope("tenant:a", Quota(token_budget=1000, budget_period="day"))
    key = Scope("key:k", Quota(token_budget=5000, budget_period="day"))
    assert limiter.admit("a", [tenant, key], 50, 50).allowed  # 900 + 100 = exactly the tenant's 1000
    assert sorted(ledger.calls) == [("key:k", T0), ("tenant:a", T0)]
    d = limiter.admit("b", [tenant, key], 1, 0)
    assert (d.reason, d.dimension) == ("insufficient_quota", "budget") and "tenant:a" in d.message
    assert limiter.admit("c", [key], 4000 - 900 - 100, 0).allowed  # the key was seeded with 900 too (from the table)
    assert not limiter.admit("d", [key], 1001, 0).allowed
    assert len(ledger.calls) == 2  # never asked again for a scope it has seen this period


def test_budget_period_change_reseeds_from_the_ledger(make_limiter: MakeLimiter) -> None:
    clock = FakeClock(T0 + 60)  # 2023-11-15; the month started on 2023-11-01
    month_start = datetime(2023, 11, 1, tzinfo=timezone.utc).timestamp()
    ledger = FakeLedger({T0: 100, month_start: 4000})
    limiter = make_limiter(clock, ledger)
    assert limiter.admit("a", _tenant(token_budget=5000, budget_period="day"), 100, 0).allowed
    # the operator switches the tenant to a monthly budget: the month's counter starts at the month's ledger total
    assert not limiter.admit("b", _tenant(token_budget=5000, budget_period="month"), 1001, 0).allowed
    assert ledger.calls == [("tenant:a", T0), ("tenant:a", month_start)]
    assert limiter.admit("b", _tenant(token_budget=5000, budget_period="month"), 1000, 0).allowed


def test_peek_reports_headers_and_consumes_nothing(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(clock)
    scopes = [Scope("tenant:a", Quota(rpm=60, tpm=6000)), Scope("key:k", Quota(tpm=3000))]
    fresh = limiter.peek(scopes)
    assert fresh == RateLimitInfo(60, 60, 0.0, 3000, 3000, 0.0)
    assert limiter.peek(scopes) == fresh  # peeking twice takes nothing
    assert limiter.admit("a", scopes, 500, 500).allowed
    after = limiter.peek(scopes)
    assert (after.remaining_requests, after.remaining_tokens) == (59, 2000)  # the key scope is the tighter one
    assert after.reset_tokens_s == pytest.approx(20.0)
    clock.t += 10  # key refills 50 tokens/s
    assert limiter.peek(scopes).remaining_tokens == 2500
    assert limiter.admit("b", scopes, 1250, 1250).allowed  # exactly the 2500 peek promised
    assert limiter.peek(scopes).remaining_tokens == 0
    assert limiter.peek(_tenant()) == RateLimitInfo()  # unlimited: no headers


def test_interface() -> None:
    memory: RateLimiter = Limiter(FakeClock())
    assert memory.blocking is False and RedisLimiter.blocking is True
    memory.renew()  # no-ops in process
    memory.close()
    unavailable = Decision(False, "unavailable", retry_after=1.0, message="the rate limiter is unavailable")
    assert unavailable.http_status == 503
    assert unavailable.headers() == {"retry-after": "1", "retry-after-ms": "1000"}
