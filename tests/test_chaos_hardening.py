"""Issue 24's chaos drills at their --quick size, each on a deployment of its own (tiny model, loopback):
pathological structured-output specs beside normal streams, stalled streams against the gateway's pending-output
bounds, and a peer with another listed CURVE key trying to take over a worker's id. See ``kvgate chaos list``
and chaos/RESULTS.md for the verdicts and what they were measured at."""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


@pytest.mark.serial
def test_hostile_schemas_quick() -> None:
    """16 streams of 1,000 tokens alone, beside the first grammar request, beside the flood (~30 s)."""
    assert_passed(run_quick("hostile-schemas"))


@pytest.mark.serial
def test_stalled_streams_quick() -> None:
    """200 streams generate until a bound cuts them; their ledger rows land the stall timeout (5 s at the quick
    size) after their clients stopped reading."""
    assert_passed(run_quick("stalled-streams"))


def test_worker_hijack_quick() -> None:
    """A second worker process starts (keys made in the deployment's directory), then 24 + 6 hijack attempts."""
    assert_passed(run_quick("worker-hijack"))
