"""Drills 1 and 2: a worker SIGKILLed, and a worker SIGSTOPped (frozen), under concurrent streams.

What the gateway must do (issue 10 draws the lines): a dead worker's streams end at once with an error event and
the supervisor starts a new one; a worker silent past ``--heartbeat-timeout`` is frozen: its streams end with an
error event and the supervisor kills and replaces it; a stop shorter than the timeout costs latency only.
"""

from __future__ import annotations

import signal
import time
from typing import ClassVar

import trio

from chaos import procs
from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, quiet_checks, record_outcomes
from chaos.drills.streams import fault_under_streams, long_streams, stream_end_checks, wait_replaced, worker_pids
from chaos.target import still_serves
from chaos.verdict import DrillResult, check

RESTART_WITHIN_S = 120.0  # a replacement worker loads its model: seconds for tiny, about a minute for smollm2


class WorkerKill(Drill):
    name = "worker-kill"
    summary = ("SIGKILL a worker under 32 concurrent streams: every stream ends within 2 s, 0 hung, the worker is "
               "back and serving, no request lost from the ledger")
    needs_processes = True
    STREAMS: ClassVar[int] = 32
    END_WITHIN_S: ClassVar[float] = 2.0

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, serve_args=("--max-num-seqs", "64", "--kv-cache-tokens", "131072"),
                              torch_threads=1 if sizing.quick else None)

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        max_tokens = 2000 if ctx.sizing.model == "tiny" else 512
        result.load = (f"{self.STREAMS} concurrent streams (/v1/completions, 32-token prompts, {max_tokens} tokens "
                       "each, ignore_eos); SIGKILL of the worker once all stream")
        [victim, *_] = worker_pids(ctx)
        since = time.time()

        async def kill() -> float:
            procs.send(victim, signal.SIGKILL)
            return trio.current_time()

        specs = long_streams(ctx, self.STREAMS, 32, max_tokens, deadline_s=900.0)
        run = await fault_under_streams(ctx, specs, kill, start_within=300.0, drain_within=30.0)
        record_outcomes(result, run.outcomes)
        result.add(*stream_end_checks(run, self.END_WITHIN_S, "kill"))
        codes = sorted({o.code or "" for o in run.outcomes if o.kind == "error_event"})
        result.measurements.update(slowest_end_after_kill_s=round(max(run.ended_after_fault(), default=0.0), 3),
                                   error_codes=",".join(codes))
        took, _ = await wait_replaced(ctx, victim, RESTART_WITHIN_S, since=run.fault_at)
        result.measurements["worker_back_after_s"] = None if took is None else round(took, 1)
        serves, how = await still_serves(ctx.client, ctx.target)
        back = f"new worker {took:.1f}s after the kill, probe {how}" if took is not None else "no new worker"
        result.add(check("the worker is back and serving", took is not None and serves, back))
        result.add(*await ledger_checks(ctx, since, run.outcomes))
        result.add(*await quiet_checks(ctx, within=30.0))


class WorkerFreeze(Drill):
    name = "worker-freeze"
    summary = ("SIGSTOP a worker past the heartbeat timeout: its streams end with a clean error, the supervisor "
               "replaces it, 0 hung; a stop below the timeout costs only latency")
    needs_processes = True
    HEARTBEAT_S: ClassVar[float] = 3.0  # the gateway's default --heartbeat-timeout, set explicitly

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, serve_args=("--heartbeat-timeout", str(self.HEARTBEAT_S)),
                              torch_threads=1 if sizing.quick else None)

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        n = 8 if ctx.sizing.quick else 16
        max_tokens = 400 if ctx.sizing.model == "tiny" else 128
        short_s, long_s = 0.4 * self.HEARTBEAT_S, self.HEARTBEAT_S + 3.0
        result.load = (f"{n} streams ({max_tokens} tokens each) per phase; SIGSTOP {short_s:g}s (below the "
                       f"{self.HEARTBEAT_S:g}s heartbeat timeout), then SIGSTOP {long_s:g}s")
        await self._short_stop(ctx, result, n, max_tokens, short_s)
        await self._long_stop(ctx, result, n, max_tokens, long_s)
        result.add(*await quiet_checks(ctx, within=30.0))

    async def _short_stop(self, ctx: DrillContext, result: DrillResult, n: int, max_tokens: int,
                          stop_s: float) -> None:
        [victim, *_] = worker_pids(ctx)

        async def pause() -> float:
            at = trio.current_time()
            procs.send(victim, signal.SIGSTOP)
            try:
                await trio.sleep(stop_s)
            finally:
                procs.send(victim, signal.SIGCONT)
            return at

        run = await fault_under_streams(ctx, long_streams(ctx, n, 32, max_tokens, 600.0), pause, 300.0, 600.0)
        record_outcomes(result, run.outcomes)
        done = sum(1 for o in run.outcomes if o.kind == "completed")
        worst_gap = max((g for o in run.outcomes for g in o.gaps), default=0.0)
        result.measurements["short_stop_worst_gap_s"] = round(worst_gap, 2)
        result.add(check(f"short stop ({stop_s:g}s): every stream completed", done == n,
                         f"{done}/{n} completed; worst gap between tokens {worst_gap:.2f}s"),
                   check("short stop: the worker was kept", victim in worker_pids(ctx), f"pid {victim}"))

    async def _long_stop(self, ctx: DrillContext, result: DrillResult, n: int, max_tokens: int,
                         stop_s: float) -> None:
        [victim, *_] = worker_pids(ctx)
        since = time.time()

        async def thaw() -> None:  # the operator's SIGCONT; a worker the supervisor killed is gone by then
            await trio.sleep(stop_s)
            procs.send(victim, signal.SIGCONT)

        async with trio.open_nursery() as nursery:
            async def freeze() -> float:
                procs.send(victim, signal.SIGSTOP)
                nursery.start_soon(thaw)
                return trio.current_time()

            run = await fault_under_streams(ctx, long_streams(ctx, n, 32, max_tokens, 600.0), freeze, 300.0,
                                            stop_s + 10.0)
        record_outcomes(result, run.outcomes)
        within = self.HEARTBEAT_S + 2.0
        result.add(*stream_end_checks(run, within, "freeze"))
        errors = sum(1 for o in run.outcomes if o.kind == "error_event")
        result.add(check("long stop: the frozen worker's streams ended with an error", errors == n,
                         f"{errors}/{n} error events ({', '.join(sorted({o.code or '' for o in run.outcomes}))})"))
        took, pids = await wait_replaced(ctx, victim, RESTART_WITHIN_S, since=run.fault_at)
        gone = not procs.alive(victim)
        result.add(check("long stop: the supervisor replaced the frozen worker", took is not None and gone,
                         f"new worker {pids} {took:.1f}s after the freeze; old pid {victim} "
                         f"{'gone' if gone else 'still alive'}" if took is not None
                         else f"no new worker; old pid {victim} {'gone' if gone else 'still alive'}"))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("long stop: serving again", serves, how))
        result.add(*await ledger_checks(ctx, since, run.outcomes))
