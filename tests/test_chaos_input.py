"""Chaos drill 10 (bad-input) at its --quick size: schemathesis over /openapi.json (tenant and admin APIs) and the
table of hostile raw requests against a spawned deployment (tiny model, loopback). No 5xx, no hang, no process
death, every refusal the application makes in OpenAI's error shape."""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

# A drill judged by a deadline of a few seconds or by a latency against a baseline is `serial`: it runs alone,
# after the parallel pass, since another test's load between its measurements would move the verdict. The
# others' deadlines (15 s and more) hold beside another test's load, and they run in the parallel pass.
pytestmark = pytest.mark.timeout(600)


def test_bad_input_quick() -> None:
    assert_passed(run_quick("bad-input"))
