"""Chaos drills about clients at their --quick size: a disconnect storm, an overload burst, slow readers.

Each spawns its own deployment (gateway + one worker on a tiny random model, fresh store, loopback). Afterwards
nothing may be held for anyone (running, KV, slots), the ledger must match the responses, and an overload may only
ever answer 200, 429 or 503 (with retry-after). No timing assertion on throughput.
"""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


def test_disconnect_storm_quick() -> None:
    assert_passed(run_quick("disconnect-storm"))


def test_overload_quick() -> None:
    assert_passed(run_quick("overload"))


@pytest.mark.serial
def test_slow_readers_quick() -> None:
    """The gateway gives a stalled stream --stream-stall-timeout (5 s at the quick size) before it cuts it."""
    assert_passed(run_quick("slow-readers"))
