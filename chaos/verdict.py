"""Verdict objects: what a drill checked, what it measured, and whether it passed.

A drill returns one ``DrillResult``: its named checks (each passed, failed or skipped with a reason), the
accounting of every request it sent (by outcome kind), and free-form measurements (latencies, memory, counts).
``to_json`` is what ``--json-out`` writes; the CLI renders the same data as a Rich table.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Measure = int | float | str | None


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""
    skipped: bool = False  # not observable here (e.g. no admin token): neither pass nor fail

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("pass" if self.passed else "FAIL")


def check(name: str, passed: bool, detail: str = "") -> Check:
    return Check(name, bool(passed), detail)


def skipped(name: str, why: str) -> Check:
    return Check(name, True, why, skipped=True)


def at_most(name: str, value: float, limit: float, unit: str = "") -> Check:
    return check(name, value <= limit, f"{_fmt(value)}{unit} (limit {_fmt(limit)}{unit})")


def equal(name: str, value: Any, expected: Any) -> Check:
    return check(name, value == expected, f"{value} (expected {expected})")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


@dataclass
class DrillResult:
    drill: str
    size: str  # "quick" or "full"
    load: str = ""  # the load used, in words (the issue asks each verdict to state it)
    checks: list[Check] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # request accounting: kind -> count
    measurements: dict[str, Measure] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # bulky evidence: in --json-out, not in the table
    seconds: float = 0.0
    error: str | None = None  # the drill itself broke (a bug in the drill or a deployment that never started)
    not_run: str | None = None  # why it could not run here (e.g. it needs its own deployment): neither pass nor fail
    log_tail: str = ""  # the deployment's last log lines when something failed

    @property
    def passed(self) -> bool:
        """No failed verdict (a drill that could not run here fails nothing)."""
        if self.not_run is not None:
            return self.error is None
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        return "SKIP" if self.not_run is not None and self.error is None else ("PASS" if self.passed else "FAIL")

    def add(self, *checks: Check) -> None:
        self.checks.extend(checks)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"], out["verdict"] = self.passed, self.verdict
        out["checks"] = [{**asdict(c), "status": c.status} for c in self.checks]
        return out


def machine() -> dict[str, Any]:
    """The machine a run happened on (verdicts are stated for a machine, as the issue asks)."""
    return {"cpu": cpu_model(), "cores": _cores(), "python": platform.python_version(), "system": platform.system()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
