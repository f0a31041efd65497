"""Issue 26's exactly-once drill: a batch through a worker SIGKILL and then a gateway SIGKILL, both mid-way.

The batch runs on the drill's own key. Once a quarter of its lines have results the worker is SIGKILLed (its lines
in flight fail with ``worker_died``, a 503 the runner waits out, and run again on the replacement); once half have
results, with lines in flight, the gateway is SIGKILLed (its workers go with it), the store is read (which lines
had no result at that moment), and the gateway is started again on the same store: it takes the runner lease over
once the dead one's expires (10 s) and runs what has no result. The verdict reads the store and the gateway's log,
never the API it judges: ``chaos.exactly_once``.
"""

from __future__ import annotations

import signal
from typing import ClassVar

import trio

from chaos import batches, procs
from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, quiet_checks
from chaos.drills.streams import wait_replaced, worker_pids
from chaos.exactly_once import billing_checks, result_checks, run_checks
from chaos.target import still_serves
from chaos.verdict import DrillResult, check

RESTART_WITHIN_S = 120.0  # a replacement worker loads its model (seconds for tiny, about a minute for smollm2)
ORPHANS_GONE_WITHIN_S = 15.0


class BatchKills(Drill):
    name = "batch-kills"
    summary = ("SIGKILL a worker, then the gateway, in the middle of a batch and restart: every line ends with exactly "
               "one result, none run twice to completion, none lost, each billed once (read from the store)")
    needs_processes = True
    spawn_only = True  # it restarts the gateway
    time_limit_s = (300.0, 1800.0)  # full size: 160 lines of smollm2 on 2 cores plus three model loads
    # (lines, prompt tokens, max_tokens, step delay s): the tiny model's steps take a millisecond, so quick runs
    # hold each step a little for the kills to land among lines in flight rather than after the batch.
    SIZES: ClassVar[dict[bool, tuple[int, int, int, str]]] = {True: (64, 16, 24, "0.01"), False: (160, 64, 64, "")}

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        delay = self.SIZES[sizing.quick][3]
        return DeploymentSpec(sizing.model_dir, torch_threads=1 if sizing.quick else None,
                              env=(("KVGATE_DEBUG_STEP_DELAY", delay),) if delay else ())

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        dep = ctx.deployment
        if dep is None or ctx.target.db_path is None:
            raise RuntimeError("batch-kills needs a spawned deployment (its store is read directly)")
        n, prompt_len, max_tokens, _ = self.SIZES[ctx.sizing.quick]
        result.load = (f"one batch of {n} /v1/completions lines ({prompt_len}-token prompts, {max_tokens} tokens each, "
                       f"8 lines in flight); worker SIGKILL at {n // 4} results, gateway SIGKILL at {n // 2}, "
                       "then the gateway started again on the same store")
        lines = batches.completion_lines(ctx.rng, ctx.target.model, n, prompt_len, max_tokens)
        api = batches.BatchClient(ctx.client, ctx.target)
        batch_id = str((await api.submit(lines))["id"])
        await self._kill_worker(ctx, result, api, batch_id, n // 4)
        log_at, unstored = await self._kill_gateway(ctx, result, api, batch_id, n // 2)
        ctx.say("starting the gateway again on the same store")
        await dep.start()
        done = await api.wait(batch_id, within=600.0)
        ctx.say(f"batch {batch_id} {done['status']}: {done.get('request_counts')}")
        fin = await batches.finished(ctx.target, batch_id)
        log = dep.log_text()
        before = batches.completions_logged(log[:log_at], batch_id)
        after = batches.completions_logged(log[log_at:], batch_id)
        result.add(*result_checks(fin, [str(line["custom_id"]) for line in lines]), *billing_checks(fin))
        runs, measured = run_checks(fin, before, after, unstored)
        result.add(*runs)
        result.measurements.update(measured, lines=n, results=len(fin.output) + len(fin.errors),
                                   ledger_rows=fin.billed_rows, output_tokens=fin.completion_tokens)
        result.add(*await quiet_checks(ctx, within=30.0))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("serving after the restart", serves, how))

    async def _kill_worker(self, ctx: DrillContext, result: DrillResult, api: batches.BatchClient, batch_id: str,
                           at: int) -> None:
        seen = await api.wait(batch_id, within=300.0, done_at_least=at)
        in_flight = await self._in_flight(ctx, batch_id)
        [victim, *_] = worker_pids(ctx)
        ctx.say(f"killing worker {victim} at {seen['request_counts']} with {in_flight} lines in flight")
        procs.send(victim, signal.SIGKILL)
        killed_at = trio.current_time()
        took, _ = await wait_replaced(ctx, victim, RESTART_WITHIN_S, since=killed_at)
        result.measurements.update(lines_in_flight_at_worker_kill=in_flight,
                                   worker_back_after_s=None if took is None else round(took, 1))
        result.add(check("the worker kill came mid-batch (lines in flight)", seen["status"] == "in_progress"
                         and in_flight > 0, f"{in_flight} lines in flight, batch {seen['status']}"),
                   check("the killed worker was replaced", took is not None,
                         f"{took:.1f}s after the kill" if took is not None else "no new worker"))

    async def _kill_gateway(self, ctx: DrillContext, result: DrillResult, api: batches.BatchClient, batch_id: str,
                            at: int) -> tuple[int, set[str]]:
        """SIGKILL once ``at`` lines have results and some are in flight; the log's length at the kill and the
        request ids of the lines that had no result right after it."""
        dep = ctx.deployment
        assert dep is not None
        await api.wait(batch_id, within=300.0, done_at_least=at)
        with trio.fail_after(120.0):  # strike while lines run (between lines the kill would prove less)
            while (in_flight := await self._in_flight(ctx, batch_id)) == 0:
                await trio.sleep(0.02)
        workers = worker_pids(ctx)
        ctx.say(f"killing the gateway (pid {dep.gateway_pid}) with {in_flight} lines in flight")
        dep.kill(signal.SIGKILL)
        dep.reap()
        log_at = len(dep.log_text())
        states = await batches.lines_now(ctx.target, batch_id)
        prefix = batches.request_prefix(batch_id)
        unstored = {f"{prefix}{s.line}" for s in states if not s.stored}
        cut = sum(1 for s in states if s.attempts > 0 and not s.stored)
        left = await procs.wait_gone(workers, ORPHANS_GONE_WITHIN_S)
        result.measurements.update(lines_in_flight_at_gateway_kill=in_flight, results_at_gateway_kill=len(states)
                                   - len(unstored), attempted_unstored_at_gateway_kill=cut,
                                   most_attempts_at_gateway_kill=max((s.attempts for s in states), default=0))
        result.add(check("the gateway kill came mid-batch (attempted lines without a result)", cut > 0,
                         f"{cut} attempted lines had no result, {len(states) - len(unstored)} of {len(states)} "
                         "had one"),
                   check(f"no orphaned workers ({ORPHANS_GONE_WITHIN_S:g}s after the gateway kill)", not left,
                         f"still alive: {left}" if left else f"{len(workers)} worker(s) gone"))
        return log_at, unstored

    async def _in_flight(self, ctx: DrillContext, batch_id: str) -> int:
        """Lines attempted and without a result: in flight (or cut by the worker kill and waiting to run again)."""
        return sum(1 for s in await batches.lines_now(ctx.target, batch_id) if s.attempts > 0 and not s.stored)
