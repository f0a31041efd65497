"""Issue 26's latency drill: interactive requests beside a batch job saturating the worker.

Goal: with a batch job saturating a worker, interactive TTFT p99 stays within 1.25x of the same interactive load
on an idle worker, and the batch still gets >= 90% of the capacity the interactive load leaves (output tokens/s).
One deployment, one worker, in this order:

1. idle: an interactive load (streamed completions arriving open-loop on a seeded Poisson schedule);
2. capacity: a batch (lines at the batch priority, ``--batch-lines-in-flight`` at once) alone on the worker, its
   output tokens/s over a window once it runs: what the worker gives the batch when nobody else asks;
3. beside: the same interactive schedule (same arrivals, prompt and output lengths; other prompt tokens, so the
   prefix cache gives the second run nothing) while the batch keeps running; then the batch is cancelled.

Token rates come from the worker's own counter (``vllm:generation_tokens_total``, 0.5 s heartbeats) over each
window; in the beside window the batch's share is that minus the interactive tokens (every request is
``ignore_eos`` with a fixed ``max_tokens``, so those are known exactly). The capacity the interactive load leaves is
the batch-alone rate minus the interactive rate of the beside window. Timing verdicts are judged at full size only
(an operator's quiet machine, ``bench/batch_interactive.py``); the quick size (CI) runs the same phases and
reports the numbers, with the timing checks skipped, because a shared CI machine's timings judge nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import trio

from chaos import batches, metrics
from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS
from chaos.load import Outcome, RequestSpec, percentile
from chaos.verdict import Check, DrillResult, Measure, at_most, check, skipped

TTFT_RATIO_GOAL = 1.25
BATCH_SHARE_GOAL = 0.90
GEN_TOKENS = "vllm:generation_tokens_total"


@dataclass(frozen=True)
class MixSizes:
    requests: int  # interactive requests per phase
    rate: float  # their mean arrivals per second
    prompt_len: int
    max_tokens: int
    batch_lines: int  # more than both windows need: what is left is cancelled
    batch_prompt_len: int
    batch_max_tokens: int
    capacity_window_s: float
    step_delay: str  # KVGATE_DEBUG_STEP_DELAY ("" none): quick runs hold the tiny model's ~1 ms steps a little


@dataclass(frozen=True)
class Phase:
    outcomes: list[Outcome]
    seconds: float  # first send to last end
    tokens: float  # generated on the worker in that window (all traffic)

    def ttfts(self) -> list[float]:
        return [t for o in self.outcomes if o.kind == "completed" and (t := o.ttft) is not None]

    def completed(self) -> int:
        return sum(1 for o in self.outcomes if o.kind == "completed")


class BatchInteractive(Drill):
    name = "batch-interactive"
    summary = ("interactive streams beside a batch saturating the worker: TTFT p99 within 1.25x of the same load on "
               "an idle worker, the batch >= 90% of the capacity left (full size; quick reports only)")
    SIZES: ClassVar[dict[bool, MixSizes]] = {
        True: MixSizes(24, 4.0, 32, 16, 3000, 32, 48, 6.0, "0.005"),
        False: MixSizes(40, 0.5, 64, 32, 2000, 128, 64, 40.0, ""),
    }
    SERVE_ARGS: ClassVar[tuple[str, ...]] = ()  # bench/batch_interactive.py tries engine settings through this
    time_limit_s = (300.0, 1200.0)

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        delay = self.SIZES[sizing.quick].step_delay
        return DeploymentSpec(sizing.model_dir, serve_args=self.SERVE_ARGS, torch_threads=1 if sizing.quick else None,
                              env=(("KVGATE_DEBUG_STEP_DELAY", delay),) if delay else ())

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        s = self.SIZES[ctx.sizing.quick]
        result.load = (f"{s.requests} streamed completions per phase ({s.prompt_len}-token prompts, {s.max_tokens} "
                       f"tokens) arriving at {s.rate:g}/s (Poisson, seeded); a batch of {s.batch_prompt_len}-token "
                       f"prompts, {s.batch_max_tokens} tokens a line, 8 lines in flight; capacity window "
                       f"{s.capacity_window_s:g}s")
        schedule = _arrivals(random.Random(f"{ctx.rng.random()}:arrivals"), s.requests, s.rate)
        await self._phase(ctx, s, [0.0] * 4)  # warm-up: first-call costs land in no measured phase
        ctx.say("interactive load on the idle worker")
        idle = await self._phase(ctx, s, schedule)
        api = batches.BatchClient(ctx.client, ctx.target)
        batch = await api.submit(batches.completion_lines(ctx.rng, ctx.target.model, s.batch_lines,
                                                          s.batch_prompt_len, s.batch_max_tokens, "bulk"))
        batch_id = str(batch["id"])
        try:
            await api.wait(batch_id, within=300.0, done_at_least=1)  # running, its lines' prompts behind it
            ctx.say("the batch alone: its capacity")
            capacity = await self._window(ctx, s.capacity_window_s)
            ctx.say("interactive load beside the batch")
            beside = await self._phase(ctx, s, schedule)
            still = await api.get(batch_id)
        finally:
            with trio.CancelScope(shield=True):
                cancelled = await api.cancel(batch_id)
        record_outcomes(result, idle.outcomes + beside.outcomes)
        ended = await api.wait(batch_id, within=180.0)
        result.add(*self._evaluate(ctx, result, s, idle, beside, capacity))
        result.add(check("the batch ran throughout the beside window", still["status"] == "in_progress",
                         f"status {still['status']} at its end, {still.get('request_counts')}"),
                   check("the batch was cancelled cleanly afterwards", ended["status"] == "cancelled",
                         f"{cancelled['status']} -> {ended['status']}, {ended.get('request_counts')}"))
        result.add(*await quiet_checks(ctx, within=60.0))

    async def _phase(self, ctx: DrillContext, s: MixSizes, schedule: list[float]) -> Phase:
        specs = [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, s.prompt_len), s.max_tokens),
                             deadline_s=120.0, send_after_s=at) for at in schedule]
        load = ctx.load(len(specs))  # open loop: every request is sent at its time, whatever the others do
        before = await metrics.scrape(ctx.client, ctx.target.url)
        started = trio.current_time()
        outcomes = await load.run(specs)
        seconds = trio.current_time() - started
        after = await metrics.scrape(ctx.client, ctx.target.url)
        return Phase(outcomes, seconds, after.total(GEN_TOKENS) - before.total(GEN_TOKENS))

    async def _window(self, ctx: DrillContext, seconds: float) -> float:
        """Output tokens/s of the worker over ``seconds``."""
        before = await metrics.scrape(ctx.client, ctx.target.url)
        started = trio.current_time()
        await trio.sleep(seconds)
        after = await metrics.scrape(ctx.client, ctx.target.url)
        return (after.total(GEN_TOKENS) - before.total(GEN_TOKENS)) / (trio.current_time() - started)

    def _evaluate(self, ctx: DrillContext, result: DrillResult, s: MixSizes, idle: Phase, beside: Phase,
                  capacity: float) -> list[Check]:
        interactive_tokens = beside.completed() * s.max_tokens
        interactive_rate = interactive_tokens / beside.seconds
        batch_rate = max(beside.tokens - interactive_tokens, 0.0) / beside.seconds
        left = capacity - interactive_rate
        share = batch_rate / left if left > 0 else None
        p = {f"{name}_p{q}": percentile(ph.ttfts(), q) for name, ph in (("idle", idle), ("beside", beside))
             for q in (50, 90, 99)}
        ratio = (p["beside_p99"] / p["idle_p99"]) if p["beside_p99"] and p["idle_p99"] else None
        m: dict[str, Measure] = {f"ttft_{k}_ms": None if v is None else round(v * 1000, 1) for k, v in p.items()}
        m.update(ttft_p99_ratio=_r(ratio), interactive_tok_s_idle=_r(idle.completed() * s.max_tokens / idle.seconds),
                 interactive_tok_s_beside=_r(interactive_rate), batch_alone_tok_s=_r(capacity),
                 batch_beside_tok_s=_r(batch_rate), capacity_left_tok_s=_r(left), batch_share_of_left=_r(share),
                 idle_phase_s=_r(idle.seconds), beside_phase_s=_r(beside.seconds))
        result.measurements.update(m)
        result.details.update(ttft_idle_ms=sorted(round(t * 1000, 1) for t in idle.ttfts()),
                              ttft_beside_ms=sorted(round(t * 1000, 1) for t in beside.ttfts()))
        n = s.requests
        out = [check("every interactive request completed, idle and beside the batch",
                     idle.completed() == n and beside.completed() == n,
                     f"idle {idle.completed()}/{n}, beside {beside.completed()}/{n}"),
               check("numbers reported (TTFT in both phases, batch tokens beside)",
                     ratio is not None and share is not None and batch_rate > 0,
                     f"TTFT p99 ratio {_r(ratio)}, batch share {_r(share)}")]
        goal_ttft = f"interactive TTFT p99 beside the batch <= {TTFT_RATIO_GOAL:g}x idle"
        goal_share = f"batch output >= {BATCH_SHARE_GOAL:.0%} of the capacity the interactive load leaves"
        if ctx.sizing.quick:
            why = "timings are judged at full size on a quiet machine (bench/batch_interactive.py), never in CI"
            return [*out, skipped(goal_ttft, why), skipped(goal_share, why)]
        return [*out, at_most(goal_ttft, ratio if ratio is not None else float("inf"), TTFT_RATIO_GOAL, "x"),
                check(goal_share, share is not None and share >= BATCH_SHARE_GOAL,
                      f"{batch_rate:.1f} of {left:.1f} tok/s left ({_r(share)}); alone {capacity:.1f} tok/s")]


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Send times (s from the phase's start) of a Poisson process: the same list drives both phases."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
