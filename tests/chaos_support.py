"""Running the ``--quick`` size of chaos drills from tests: in-process (trio.run of the runner), one fresh
deployment per drill, and a failure message that carries the whole verdict (checks, outcomes, the log tail)."""

from __future__ import annotations

import json

import trio

from chaos.drills import by_name
from chaos.runner import RunOptions, run_drills
from chaos.verdict import DrillResult


def run_quick(*names: str) -> list[DrillResult]:
    drills = by_name()
    return trio.run(run_drills, [drills[n] for n in names], RunOptions(quick=True))


def explain(result: DrillResult) -> str:
    body = result.to_json()
    tail = body.pop("log_tail", "")
    return json.dumps(body, indent=1) + "\n--- gateway log tail ---\n" + tail


def assert_passed(results: list[DrillResult]) -> None:
    failed = [r for r in results if not r.passed]
    assert not failed, "\n\n".join(explain(r) for r in failed)
