"""Drill 3: slow steps are load, never failure (the liveness issue's promise, checked from outside).

The worker is made slow, so that single engine steps run longer than the gateway's heartbeat timeout: at the
quick size with the worker's ``KVGATE_DEBUG_STEP_DELAY`` hook (every step spins that long holding the GIL, as
Python between torch ops does on a slow machine), at the full size for real, with long prompts on the default model
and a large step budget. Verdict: every stream completes, none hangs, no worker is lost or restarted, and the
longest step seen really was past the heartbeat timeout (else the drill proved nothing and says so).
"""

from __future__ import annotations

import time
from typing import ClassVar

import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, quiet_checks, record_outcomes
from chaos.drills.streams import long_streams, worker_pids
from chaos.load import Outcome
from chaos.metrics import MetricsWatch, scrape
from chaos.verdict import DrillResult, check, equal

HEARTBEAT_S = 3.0
QUICK_STEP_DELAY_S = 4.0  # > HEARTBEAT_S: every quick step outlasts the heartbeat timeout
FULL_STEP_BUDGET = 4096  # tokens per step at the full size: long prefill steps on a 2-core CPU
LOST = "kvgate:workers_lost_total"
STEP_SECONDS = "kvgate:worker_step_seconds"


class SlowSteps(Drill):
    name = "slow-steps"
    summary = ("a worker whose steps outlast the heartbeat timeout (long prompts, small machine): 0 failures, only "
               "latency")
    needs_processes = True
    spawn_only = True  # it makes the worker slow (step budget, step-delay hook): only at start-up
    STREAMS: ClassVar[int] = 8

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        args = ("--heartbeat-timeout", str(HEARTBEAT_S))
        if sizing.quick:
            return DeploymentSpec(sizing.model_dir, serve_args=args, torch_threads=1,
                                  env=(("KVGATE_DEBUG_STEP_DELAY", str(QUICK_STEP_DELAY_S)),))
        return DeploymentSpec(sizing.model_dir, serve_args=(*args, "--max-num-batched-tokens", str(FULL_STEP_BUDGET),
                                                            "--max-model-len", "4096"))

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        # Quick: two tokens, so every stream lives through a few 4 s steps (its prefill's, the others' and a
        # decode) without a 4 s step per extra token.
        prompt_len, max_tokens = (64, 2) if ctx.sizing.quick else (3000, 32)
        how = (f"every step delayed {QUICK_STEP_DELAY_S:g}s (KVGATE_DEBUG_STEP_DELAY)" if ctx.sizing.quick
               else f"--max-num-batched-tokens {FULL_STEP_BUDGET}")
        result.load = (f"{self.STREAMS} concurrent streams, {prompt_len}-token prompts, {max_tokens} tokens each; "
                       f"{how}; heartbeat timeout {HEARTBEAT_S:g}s")
        pids_before = worker_pids(ctx)
        lost_before = (await scrape(ctx.client, ctx.target.url)).total(LOST)
        since = time.time()
        watch = MetricsWatch(ctx.client, ctx.target.url, (STEP_SECONDS,))
        load = ctx.load(self.STREAMS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            outcomes = await load.run(long_streams(ctx, self.STREAMS, prompt_len, max_tokens, deadline_s=900.0))
            nursery.cancel_scope.cancel()
        record_outcomes(result, outcomes)
        self._verdict(result, outcomes, watch)
        lost = (await scrape(ctx.client, ctx.target.url)).total(LOST) - lost_before
        result.add(equal("no worker lost (workers_lost_total unchanged)", lost, 0),
                   equal("the same worker process throughout", worker_pids(ctx), pids_before))
        result.add(*await ledger_checks(ctx, since, outcomes))
        result.add(*await quiet_checks(ctx, within=60.0))

    def _verdict(self, result: DrillResult, outcomes: list[Outcome], watch: MetricsWatch) -> None:
        done = sum(1 for o in outcomes if o.kind == "completed")
        hung = sum(1 for o in outcomes if o.kind == "hung")
        # The longest step as the gateway saw it (heartbeats carry the current step's age); a gateway without
        # that series is judged by the longest gap between two tokens, which spans at least one whole step.
        gap = max((g for o in outcomes for g in o.gaps), default=0.0)
        longest = watch.peak[STEP_SECONDS] or gap
        result.measurements.update(longest_step_seen_s=round(watch.peak[STEP_SECONDS], 2),
                                   longest_token_gap_s=round(gap, 2),
                                   ttft_max_s=round(max((o.ttft or 0.0 for o in outcomes), default=0.0), 2))
        result.add(check("steps ran past the heartbeat timeout (the fault was real)", longest > HEARTBEAT_S,
                         f"longest step {longest:.1f}s, timeout {HEARTBEAT_S:g}s"),
                   check("0 failures: every stream completed", done == len(outcomes),
                         f"{done}/{len(outcomes)} completed"),
                   equal("0 hung", hung, 0))
