"""Chaos drill 10 (bad-input) at its --quick size: schemathesis over /openapi.json (tenant and admin APIs) and the
table of hostile raw requests against a spawned deployment (tiny model, loopback). No 5xx, no hang, no process
death, every refusal the application makes in OpenAI's error shape."""

from __future__ import annotations

import pytest

from tests.chaos_support import assert_passed, run_quick

pytestmark = [pytest.mark.timeout(600), pytest.mark.serial]  # drills judge deadlines and latencies: alone


def test_bad_input_quick() -> None:
    assert_passed(run_quick("bad-input"))
