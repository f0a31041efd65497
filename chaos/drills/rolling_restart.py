"""A rolling restart of two workers under 16 concurrent streams (issue 14 item 5), the way an operator does it:
``kvgatectl worker restart --all`` drains one worker (it takes nothing new, finishes its streams, exits, and its
supervisor starts a fresh process), waits for the fresh one, then does the next. Sixteen clients stream back to
back from before the roll until it is over, so each drain finds streams to finish and new requests keep arriving
while one worker is away. The verdict: every stream completed ([DONE], no error event), both worker pids changed,
each drained worker held streams at its drain, one ledger row per request, quiet afterwards.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, ClassVar

import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS
from chaos.load import RequestSpec
from chaos.verdict import DrillResult, check, equal


class RollingRestart(Drill):
    name = "rolling-restart"
    summary = ("restart both workers one at a time (kvgatectl worker restart --all) under 16 concurrent streams: "
               "0 failed streams, both worker pids changed, no request lost from the ledger")
    spawn_only = True  # restarts the deployment's workers: its own two-worker deployment
    STREAMS: ClassVar[int] = 16
    # Both drains (each waits for up to 16 streams) and both fresh starts: on a busy 2-core box smollm2 took 4.5
    # minutes per worker (a 3-minute drain, a 1-minute start).
    ROLL_WITHIN_S: ClassVar[float] = 1500.0
    time_limit_s = (600.0, 1800.0)

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, workers=2, torch_threads=1 if sizing.quick else None)

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        max_tokens = 200 if ctx.sizing.model == "tiny" else 64
        result.load = (f"{self.STREAMS} clients streaming back to back (/v1/completions, 32-token prompts, "
                       f"{max_tokens}-{max_tokens + 105} tokens each, ignore_eos) from before the roll until it ended")
        before = await _both_workers(ctx)
        since = time.time()
        load = ctx.load(self.STREAMS)
        rolled = trio.Event()

        def spec(n: int) -> RequestSpec:  # lengths vary so the streams do not start and end in lockstep
            return RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 32), max_tokens + 7 * (n % 16)),
                               deadline_s=600.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run_until, rolled, spec)
            streaming = await load.wait_streaming(self.STREAMS, 300.0)
            ctx.say(f"{len(load.streaming)} streams running; kvgatectl worker restart --all")
            roll = await self._roll(ctx)
            rolled.set()
            ctx.say("roll done; letting the last streams finish")
        record_outcomes(result, load.outcomes)
        after = await _worker_pids(ctx)
        self._judge(result, streaming, roll, load.outcomes, before, after)
        result.add(*await ledger_checks(ctx, since, load.outcomes))
        result.add(*await quiet_checks(ctx, within=30.0))

    async def _roll(self, ctx: DrillContext) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "console.kvgatectl", "--url", ctx.target.url, "--admin-token",
               ctx.target.admin_token or "", "worker", "restart", "--all", "--timeout", "600", "--json"]
        with trio.move_on_after(self.ROLL_WITHIN_S):
            p = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
            try:
                data = json.loads(p.stdout)["data"] if p.returncode == 0 else None
            except (ValueError, KeyError):
                data = None
            return {"rc": p.returncode, "data": data, "stderr": p.stderr.decode(errors="replace")[-2000:]}
        return {"rc": None, "data": None, "stderr": f"did not finish within {self.ROLL_WITHIN_S:g}s"}

    @staticmethod
    def _judge(result: DrillResult, streaming: bool, roll: dict[str, Any], outcomes: list[Any],
               before: dict[str, int], after: dict[str, int]) -> None:
        steps = roll["data"] or []
        result.details["roll"] = roll
        result.measurements.update(streams=len(outcomes), **{f"{s['worker']}_back_after_s": s["seconds"]
                                                              for s in steps})
        failed = [o for o in outcomes if o.kind != "completed" or not o.shape_ok]
        kinds = sorted({f"{o.kind}:{o.code}" for o in failed})
        result.add(
            check(f"all {RollingRestart.STREAMS} streams were running when the roll began", streaming),
            check("kvgatectl worker restart --all succeeded", roll["rc"] == 0 and bool(steps),
                  f"rc {roll['rc']}: " + (", ".join(f"{s['worker']} pid {s['old_pid']} -> {s['new_pid']} in "
                                                    f"{s['seconds']}s" for s in steps) or roll["stderr"][-300:])),
            # The first drain surely finds streams (all 16 run over both workers); the second usually does too, but
            # whether its streams all ended just as the first worker came back is timing, not a verdict.
            check("the first drain found streams to finish", bool(steps) and steps[0]["in_flight_at_drain"] > 0,
                  "in flight at each drain: " + ", ".join(f"{s['worker']} {s['in_flight_at_drain']}" for s in steps)),
            equal("failed streams", len(failed), 0),
            check("every stream completed with [DONE]", not failed,
                  f"{len(outcomes) - len(failed)}/{len(outcomes)} completed" + (f"; {', '.join(kinds[:4])}"
                                                                                if kinds else "")),
            check("both worker pids changed", set(before) == set(after) and len(after) == 2 and
                  all(before[w] != after[w] for w in before), f"before {before}, after {after}"),
        )


async def _both_workers(ctx: DrillContext, within: float = 300.0) -> dict[str, int]:
    """The two workers' pids, once both are live (the deployment is ready as soon as one is)."""
    with trio.move_on_after(within):
        while len(pids := await _worker_pids(ctx)) < 2:
            await trio.sleep(0.2)
        return pids
    return await _worker_pids(ctx)


async def _worker_pids(ctx: DrillContext) -> dict[str, int]:
    data = await ctx.target.admin(ctx.client, "GET", "/workers")
    return {str(r["worker"]): int(r["hello"]["pid"]) for r in data["data"]}
