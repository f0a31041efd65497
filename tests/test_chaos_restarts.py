"""Chaos drills that restart or break what the deployment stands on, at their --quick size: the gateway SIGKILLed
under load and started again (ledger = responses that got their final chunk, no orphaned worker, quotas consistent
with the ledger), Redis stopped and restarted under two gateways, the store locked and then its disk full. Each
spawns its own deployment (tiny model, fresh store, loopback)."""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


def test_gateway_kill_quick() -> None:
    assert_passed(run_quick("gateway-kill"))


def test_redis_outage_quick() -> None:
    """Two gateways on one Redis (fail-closed and fail-open); Redis stopped 6 s and restarted empty."""
    from chaos.redis_proc import redis_available

    if not redis_available():
        pytest.skip("redis-server is not on PATH (make test installs it)")
    assert_passed(run_quick("redis-outage"))


def test_store_trouble_quick() -> None:
    """The store locked 15 s by another writer (longer, until a ledger commit gave up), then its tmpfs full 5 s (that
    phase skips without root)."""
    assert_passed(run_quick("store-trouble"))
