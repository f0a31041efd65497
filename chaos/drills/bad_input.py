"""Drill 10: bad input. The gateway publishes ``/openapi.json``; schemathesis fuzzes every operation in it (the tenant
API with a tenant key, the admin API with the admin token), then the table of hostile inputs (``hostile.py``) goes
in raw. Verdict: 0 5xx, 0 hangs, 0 process deaths, every refusal the application makes in OpenAI's error shape.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, quiet_checks
from chaos.drills.hostile import Hostile, Inputs, cases
from chaos.drills.streams import worker_pids
from chaos.metrics import scrape
from chaos.procs import alive
from chaos.rawhttp import RawAnswer, exchange
from chaos.sse import error_of
from chaos.target import still_serves
from chaos.verdict import Check, DrillResult, check, equal, skipped

LOST = "kvgate:workers_lost_total"
ANSWER_WITHIN_S = 60.0  # a hostile request's answer (a 10 MB body on a loaded 2-core machine included)
SCHEMATHESIS = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"
_CASES_RE = re.compile(r"(\d+) generated")


class BadInput(Drill):
    name = "bad-input"
    summary = ("schemathesis against /openapi.json plus a table of hostile inputs (deep nesting, 10 MB bodies, "
               "invalid UTF-8, NaN, huge numbers, unknown fields, content types, header tricks): 0 5xx, 0 deaths, "
               "every refusal in OpenAI's error shape")
    needs_processes = True
    EXAMPLES: ClassVar[dict[bool, int]] = {True: 10, False: 100}  # schemathesis cases per operation

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        # Many hostile cases fail authentication on purpose: the per-address limiter would turn the rest into 429s.
        return DeploymentSpec(sizing.model_dir, serve_args=("--auth-failures-per-minute", "100000"),
                              torch_threads=1 if sizing.quick else None)

    def quota(self, sizing: Sizing) -> dict[str, int] | None:
        return {"max_tokens_per_request": 16}  # fuzzed requests that reach the model stay short

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        n = self.EXAMPLES[ctx.sizing.quick]
        table = cases()
        result.load = (f"schemathesis (positive and negative data, {n} cases per operation, no 5xx + error shape) "
                       f"on the tenant and admin APIs; {len(table)} hostile raw requests")
        pids = {"gateway": ctx.gateway_pid, **{f"worker {p}": p for p in worker_pids(ctx)}}
        lost_before = (await scrape(ctx.client, ctx.target.url)).total(LOST)
        r = await ctx.client.get(f"{ctx.target.url}/openapi.json")
        paths = r.json().get("paths", {}) if r.status_code == 200 else {}
        result.add(check("/openapi.json is published", bool(paths), f"HTTP {r.status_code}, {len(paths)} paths"))
        if paths:
            result.add(*await self._fuzz_both(ctx, result, n))
        result.add(*await self._hostile(ctx, result, table))
        lost = (await scrape(ctx.client, ctx.target.url)).total(LOST) - lost_before
        dead = [name for name, pid in pids.items() if pid is not None and not alive(pid)]
        result.add(check("0 process deaths", not dead and lost == 0, f"dead: {dead or 'none'}; workers lost {lost:g}"))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("still serving afterwards", serves, how))
        result.add(*await quiet_checks(ctx, within=60.0))

    async def _fuzz_both(self, ctx: DrillContext, result: DrillResult, n: int) -> list[Check]:
        """The tenant API and (with an admin token) the admin API, fuzzed side by side: two schemathesis
        processes against one gateway, its answers judged per request either way."""
        runs = [("tenant API", ctx.target.api_key, "--exclude-path-regex")]
        if ctx.target.admin_token:
            runs.append(("admin API", ctx.target.admin_token, "--include-path-regex"))
        checks: list[Check | None] = [None] * len(runs)

        async def one(i: int) -> None:
            checks[i] = await self._fuzz(ctx, result, *runs[i], n)

        async with trio.open_nursery() as nursery:
            for i in range(len(runs)):
                nursery.start_soon(one, i)
        return [c for c in checks if c is not None]

    async def _fuzz(self, ctx: DrillContext, result: DrillResult, what: str, token: str, path_flag: str,
                    n: int) -> Check:
        name = f"schemathesis on the {what}: no 5xx, refusals in OpenAI's shape"
        try:
            import schemathesis  # noqa: F401
        except ImportError:
            return skipped(name, "schemathesis is not installed (pip install schemathesis)")
        cmd = [sys.executable, "-c", SCHEMATHESIS, "run", f"{ctx.target.url}/openapi.json",
               "--checks", "not_a_server_error,response_schema_conformance", "-H", f"Authorization: Bearer {token}",
               path_flag, "^/admin", "--max-examples", str(n), "--seed", str(ctx.rng.randrange(1 << 30)),
               "--generation-database", "none", "--workers", "1", "--request-timeout", "60", "--no-color"]
        with trio.fail_after(900):
            done = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
        out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        found = _CASES_RE.search(out)
        result.measurements[f"schemathesis_{what.split()[0]}_cases"] = int(found.group(1)) if found else None
        detail = f"{found.group(0) if found else '? generated'}, exit {done.returncode}"
        if done.returncode != 0:
            detail += ": " + _failures(out)
        return check(name, done.returncode == 0, detail)

    async def _hostile(self, ctx: DrillContext, result: DrillResult, table: Sequence[Hostile]) -> list[Check]:
        parts = urlsplit(ctx.target.url)
        inputs = Inputs(ctx.target.api_key, ctx.target.model)
        bad: list[str] = []
        statuses: dict[str, int | None] = {}
        for case in table:
            answer = await exchange(parts.hostname or "127.0.0.1", parts.port or 80, case.request(inputs),
                                    ANSWER_WITHIN_S)
            statuses[case.name] = answer.status
            problem = _judge(case, answer)
            if problem:
                bad.append(f"{case.name}: {problem}")
        result.details["hostile_statuses"] = statuses
        counts = Counter("closed" if s is None else str(s) for s in statuses.values())
        result.measurements["hostile_answers"] = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))
        fivexx = sum(1 for s in statuses.values() if s is not None and s >= 500)
        return [equal("hostile inputs: 0 5xx", fivexx, 0),
                check("hostile inputs: every one answered in time, refusals in OpenAI's shape", not bad,
                      "; ".join(bad[:6]) if bad else f"{len(table)} cases")]


def _judge(case: Hostile, answer: RawAnswer) -> str:
    """What is wrong with this answer to this case ('' when nothing)."""
    if answer.hung:
        return f"no answer within {ANSWER_WITHIN_S:g}s"
    if answer.status is None:
        return "" if not case.app else f"closed without an answer ({answer.body[:60]!r})"
    if answer.status >= 500:
        return f"HTTP {answer.status}"
    if case.app and answer.status >= 400 and error_of(answer.body) is None:
        return f"HTTP {answer.status} not in OpenAI's error shape: {answer.body[:80]!r}"
    return ""


def _failures(out: str) -> str:
    """The first failure lines of a schemathesis report, for the verdict's detail."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("_", "-", "Server error", "Network Error", "Response violates",
                                                 "curl", "[5"))]
    return " | ".join(keep[:6])[:600] or " | ".join(lines[-6:])[:600]
