"""Chaos drills 1-3 at their --quick size: a worker SIGKILLed and SIGSTOPped under streams, and slow steps.

Each drill spawns its own deployment (gateway + one worker on a tiny random model, fresh store, loopback) and
must reach its verdict: see ``kvgate chaos list``. No timing assertion on throughput: the only time bounds are the
issue's (streams end within 2 s of a kill, within the heartbeat timeout + 2 s of a freeze).
"""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


@pytest.mark.serial
def test_worker_kill_quick() -> None:
    assert_passed(run_quick("worker-kill"))


@pytest.mark.serial
def test_worker_freeze_quick() -> None:
    assert_passed(run_quick("worker-freeze"))


@pytest.mark.serial
def test_slow_steps_quick() -> None:
    assert_passed(run_quick("slow-steps"))
