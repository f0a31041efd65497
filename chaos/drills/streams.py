"""Shared shape of the worker drills: N long streams running, a fault injected once all of them stream, the load
drained for a bounded time, then the accounting of when each stream ended relative to the fault."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from chaos import procs
from chaos.drills.base import DrillContext, prompt_ids
from chaos.load import Outcome, RequestSpec
from chaos.verdict import Check, check

COMPLETIONS = "/v1/completions"


@dataclass
class FaultRun:
    outcomes: list[Outcome]
    fault_at: float  # trio clock when the fault was injected (0.0: never: the streams did not all start)
    all_streaming: bool

    def ended_after_fault(self) -> list[float]:
        """Seconds from the fault to the end of each stream that was still open at the fault."""
        return [o.ended_at - self.fault_at for o in self.outcomes if o.ended_at is not None and
                o.ended_at > self.fault_at]

    def hung(self) -> int:
        return sum(1 for o in self.outcomes if o.kind == "hung")


def long_streams(ctx: DrillContext, n: int, prompt_len: int, max_tokens: int, deadline_s: float) -> list[RequestSpec]:
    return [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, prompt_len), max_tokens), deadline_s)
            for _ in range(n)]


async def fault_under_streams(ctx: DrillContext, specs: Sequence[RequestSpec], fault: Callable[[], Awaitable[float]],
                              start_within: float, drain_within: float) -> FaultRun:
    """Run ``specs`` at full concurrency; once every one streams (or ``start_within`` passes) call ``fault``
    (returns the trio time it struck); then give the streams ``drain_within`` seconds to end."""
    load = ctx.load(len(specs))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, specs)
        all_streaming = await load.wait_streaming(len(specs), start_within)
        ctx.say(f"{len(load.streaming)} of {len(specs)} streams running; injecting the fault")
        fault_at = await fault()
        if not await load.wait_done(drain_within):
            load.stop()
    return FaultRun(load.outcomes, fault_at, all_streaming)


def stream_end_checks(run: FaultRun, within_s: float, what: str) -> list[Check]:
    late = run.ended_after_fault()
    worst = max(late, default=0.0)
    clean_kinds = {"completed", "error_event"}
    unclean = [o for o in run.outcomes if o.kind not in clean_kinds or not o.shape_ok]
    kinds = sorted({f"{o.kind}:{o.code}" for o in unclean})
    return [
        check("all streams were running at the fault", run.all_streaming,
              f"{len(run.outcomes)} streams" if run.all_streaming else "some had not started: fault came early"),
        check(f"every stream ended within {within_s:g}s of the {what}", run.hung() == 0 and worst <= within_s,
              f"slowest {worst:.2f}s, {run.hung()} never ended"),
        check("0 hung", run.hung() == 0, f"{run.hung()} hung"),
        check("each ended with [DONE] or an OpenAI-shaped error event", not unclean,
              f"{len(unclean)} otherwise: {', '.join(kinds[:4])}" if unclean else "all clean"),
    ]


async def wait_replaced(ctx: DrillContext, victim: int, within: float,
                        since: float | None = None) -> tuple[float | None, list[int]]:
    """Seconds (from ``since``, a trio time, default now) until a worker other than ``victim`` is alive under the
    gateway and the gateway is ready (None when that did not happen within ``within``); also the worker pids."""
    start = trio.current_time() if since is None else since
    pids: list[int] = []
    with trio.move_on_after(within):
        while True:
            pids = worker_pids(ctx)
            if any(p != victim for p in pids):
                r = await ctx.client.get(f"{ctx.target.url}/ready")
                if r.status_code == 200:
                    return trio.current_time() - start, pids
            await trio.sleep(0.2)
    return None, pids


def worker_pids(ctx: DrillContext) -> list[int]:
    if ctx.deployment is not None:
        return ctx.deployment.worker_pids()
    return procs.worker_pids(ctx.gateway_pid) if ctx.gateway_pid is not None else []
