"""Drill 5: a burst of ten times what the deployment can run at once, all sent together.

The deployment runs ``--max-num-seqs C`` sequences per step, queues at most ``2C`` per worker before answering 503,
and the drill tenant may start ``6C`` requests a minute (429 past that). A burst of ``10C`` (half streaming, half
plain) must get only 200, 429 and 503, every refusal with retry-after and OpenAI's error shape, no other 5xx, no
process death and bounded memory; the admitted requests' TTFT percentiles are reported.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, ClassVar

import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS, worker_pids
from chaos.load import Outcome, RequestSpec, percentile
from chaos.metrics import scrape
from chaos.procs import RssWatch, alive
from chaos.target import ProvisionError
from chaos.verdict import Check, DrillResult, at_most, check, equal, skipped

LOST = "kvgate:workers_lost_total"
GATEWAY_GROWTH_MIB = 256.0  # the gateway's RSS may grow this much under the burst, no more
WORKER_GROWTH_MIB = 512.0  # KV is allocated at start; a worker grows only by activations and bookkeeping


class Overload(Drill):
    name = "overload"
    summary = ("a burst of 10x what the deployment can run at once: only 200, 429 and 503 (with retry-after), 0 "
               "other 5xx, 0 process deaths, memory bounded; the admitted requests' p99 TTFT reported")
    needs_processes = True
    # --max-num-seqs: sequences one step can run (the full size keeps the default, 64: a burst of 640)
    CAPACITY: ClassVar[dict[bool, int]] = {True: 8, False: 64}

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        c = self.CAPACITY[sizing.quick]
        return DeploymentSpec(sizing.model_dir, serve_args=("--max-num-seqs", str(c), "--max-queued-requests",
                                                            str(2 * c)), torch_threads=1 if sizing.quick else None)

    def quota(self, sizing: Sizing) -> dict[str, Any] | None:
        return {"rpm": 6 * self.CAPACITY[sizing.quick]}

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        c = self.CAPACITY[ctx.sizing.quick] if ctx.deployment is not None else await _capacity(ctx)
        burst, max_tokens = 10 * c, 32 if ctx.sizing.quick else 16
        limits = f"queue bound {2 * c}, tenant rpm {6 * c}" if ctx.deployment is not None else "its own limits"
        result.load = (f"burst of {burst} requests at once (10 x {c} sequences the workers run at once; {limits}), "
                       f"half streaming, 24-token prompts, {max_tokens} tokens each")
        specs = [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 24), max_tokens, stream=i % 2 == 0),
                             deadline_s=600.0) for i in range(burst)]
        pids = {f"worker {p}": p for p in worker_pids(ctx)}
        if ctx.gateway_pid is not None:
            pids["gateway"] = ctx.gateway_pid
        lost_before = (await scrape(ctx.client, ctx.target.url)).total(LOST)
        rss = RssWatch(pids)
        since = time.time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rss.run)
            outcomes = await ctx.load(burst).run(specs)
            nursery.cancel_scope.cancel()
        record_outcomes(result, outcomes)
        result.add(*self._answers(outcomes, overload_expected=ctx.deployment is not None))
        lost = (await scrape(ctx.client, ctx.target.url)).total(LOST) - lost_before
        dead = [name for name, pid in pids.items() if not alive(pid)]
        result.add(check("0 process deaths", not dead and lost == 0, f"dead: {dead or 'none'}; workers lost {lost:g}"))
        result.add(*self._memory(rss))
        self._latency(result, outcomes)
        result.add(*await ledger_checks(ctx, since, outcomes))
        result.add(*await quiet_checks(ctx, within=60.0))

    def _answers(self, outcomes: list[Outcome], overload_expected: bool) -> list[Check]:
        statuses = Counter(o.status for o in outcomes)
        refused = [o for o in outcomes if o.status in (429, 503)]
        no_retry = [o for o in refused if not (o.retry_after or "").isdigit() or int(o.retry_after or 0) < 1]
        unclean = Counter(f"{o.kind}:{o.code}" for o in outcomes if not o.clean)
        admitted_unfinished = sum(1 for o in outcomes if o.status == 200 and o.kind != "completed")
        return [
            check("only 200, 429 and 503", set(statuses) <= {200, 429, 503},
                  ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=lambda kv: str(kv[0])))),
            check("every 429/503 has retry-after (whole seconds >= 1)", not no_retry,
                  f"{len(refused) - len(no_retry)}/{len(refused)} do"),
            check("every request ended cleanly (no other 5xx, transport error, truncation or hang)", not unclean,
                  ", ".join(f"{k} x{v}" for k, v in unclean.most_common(4)) or f"{len(outcomes)} accounted"),
            equal("every admitted request completed", admitted_unfinished, 0),
            check("all of 200, 429 and 503 seen (the burst did overload)", {200, 429, 503} <= set(statuses),
                  "refusal codes: " + ", ".join(sorted({o.code or "" for o in refused}))) if overload_expected
            else skipped("all of 200, 429 and 503 seen", "a running deployment's own limits decide what it refuses"),
        ]

    def _memory(self, rss: RssWatch) -> list[Check]:
        out = []
        for name in rss.pids:
            limit = GATEWAY_GROWTH_MIB if name == "gateway" else WORKER_GROWTH_MIB
            out.append(at_most(f"{name} memory bounded (RSS growth)", round(rss.growth_mib(name), 1), limit, " MiB"))
        return out

    def _latency(self, result: DrillResult, outcomes: list[Outcome]) -> None:
        """TTFT of the admitted streams (a plain response shows no first token) and end-to-end of all admitted."""
        done = [o for o in outcomes if o.kind == "completed"]
        ttfts = [o.ttft for o in done if o.streamed and o.ttft is not None]
        e2e = [o.ended_at - o.started for o in done if o.ended_at is not None]
        for name, values in (("ttft", ttfts), ("e2e", e2e)):
            for q in (50, 99):
                value = percentile(values, q)
                result.measurements[f"admitted_{name}_p{q}_s"] = None if value is None else round(value, 3)
        result.measurements["admitted"] = len(done)


async def _capacity(ctx: DrillContext) -> int:
    """Sequences a running deployment's workers run at once (their Hello's max_num_seqs; 64 each if unknown)."""
    try:
        body = await ctx.target.admin(ctx.client, "GET", "/workers")
        return sum(int(w["hello"].get("max_num_seqs") or 64) for w in body["data"]) or 64
    except (ProvisionError, KeyError, TypeError, ValueError):
        return 64
