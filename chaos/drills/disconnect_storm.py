"""Drill 4: a storm of streaming clients that go away at random points.

Each stream (a chat completion, so its first event, the role chunk, carries the request id before any token) is
dropped at one of four points: before any answer (a few ms after sending), right after its first event (before the
first token), during a long prompt's prefill, or mid-decode after a random number of tokens; a tenth run to the end
as a control. Afterwards the deployment must hold nothing for any of them: 0 running, 0 KV blocks held by
requests, 0 concurrency slots, and exactly one ledger row per admitted request, ``cancelled`` where it was.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, ClassVar

from chaos import ledger
from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, quiet_checks, record_outcomes
from chaos.load import Drop, Outcome, RequestSpec
from chaos.metrics import scrape
from chaos.verdict import DrillResult, check, equal, skipped

CHAT = "/v1/chat/completions"
WORDS = ("river", "stone", "lamp", "orbit", "cedar", "violet", "harbor", "signal", "meadow", "copper", "quiet",
         "ember", "lattice", "north", "paper", "tide")
SUCCESS = "vllm:request_success_total"
CANCELLED = "kvgate:client_cancellations_total"


def text(ctx: DrillContext, words: int) -> str:
    return " ".join(ctx.rng.choice(WORDS) for _ in range(words))


class DisconnectStorm(Drill):
    name = "disconnect-storm"
    summary = ("1,000 streams dropped at random points (before the first token, in prefill, mid-decode) at "
               "concurrency 64: then 0 running, 0 KV blocks, 0 slots held, one ledger row per admitted request, "
               "cancelled where it was")
    SIZES: ClassVar[dict[bool, tuple[int, int, int, int]]] = {True: (160, 16, 64, 1000), False: (1000, 64, 96, 600)}

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, serve_args=("--max-num-seqs", "64", "--kv-cache-tokens", "65536"),
                              torch_threads=1 if sizing.quick else None)

    def plan(self, ctx: DrillContext, n: int, max_tokens: int, long_words: int) -> list[RequestSpec]:
        specs = []
        for _ in range(n):
            point = ctx.rng.choices(("before-answer", "before-first-token", "in-prefill", "mid-decode", "none"),
                                    weights=(2, 2, 2, 3, 1))[0]
            words = long_words if point == "in-prefill" else ctx.rng.randint(8, 48)
            body: dict[str, Any] = ctx.chat(text(ctx, words), max_tokens)
            drop: Drop | None = {
                "before-answer": Drop(after_s=ctx.rng.uniform(0.0, 0.05), label=point),
                "before-first-token": Drop(after_events=1, label=point),
                "in-prefill": Drop(after_s=ctx.rng.uniform(0.05, 1.5), label=point),
                "mid-decode": Drop(after_events=1 + ctx.rng.randint(1, max_tokens - 1), label=point),
                "none": None}[point]
            specs.append(RequestSpec(CHAT, body, deadline_s=600.0, drop=drop))
        return specs

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        n, concurrency, max_tokens, long_words = self.SIZES[ctx.sizing.quick]
        result.load = (f"{n} chat streams at concurrency {concurrency}, {max_tokens} tokens each (ignore_eos), "
                       f"dropped before any answer / before the first token / in a {long_words}-word prompt's "
                       "prefill / mid-decode (2:2:2:3), 1 in 10 not dropped")
        specs = self.plan(ctx, n, max_tokens, long_words)
        before = await scrape(ctx.client, ctx.target.url)
        since = time.time()
        outcomes = await ctx.load(concurrency).run(specs)
        record_outcomes(result, outcomes)
        result.measurements.update(self._by_point(outcomes))
        failures = [o for o in outcomes if not o.clean]
        kinds = Counter(f"{o.kind}:{o.code}" for o in failures)
        result.add(check("every request ended cleanly (dropped, completed or refused; none hung)", not failures,
                         ", ".join(f"{k} x{v}" for k, v in kinds.most_common(4)) or f"{len(outcomes)} accounted"))
        result.add(*await ledger_checks(ctx, since, outcomes))  # waits for the last rows to land
        after = await scrape(ctx.client, ctx.target.url)  # before the slot probe adds a request of its own
        result.add(*await self._gateway_counts(ctx, since, before.total(SUCCESS), after.total(SUCCESS),
                                               after.total(CANCELLED) - before.total(CANCELLED)))
        result.add(*await quiet_checks(ctx, within=30.0))

    def _by_point(self, outcomes: list[Outcome]) -> dict[str, int]:
        """Outcomes by planned drop point, and whether the client had seen a token when it left (a drop timed to
        land in prefill only does when the prefill takes long enough, which this counts rather than assumes)."""
        def key(o: Outcome) -> str:
            seen = "" if o.kind != "dropped" else ("_after_tokens" if o.first_token_at else "_before_tokens")
            return f"{(o.drop_label or 'not-dropped').replace('-', '_')}__{o.kind}{seen}"

        return dict(sorted(Counter(key(o) for o in outcomes).items()))

    async def _gateway_counts(self, ctx: DrillContext, since: float, success_before: float, success_after: float,
                              cancelled: float) -> list[Any]:
        """The gateway's own counts agree with its ledger: one finished request (any reason) per row, and one
        client cancellation per ``cancelled`` row. Only on a deployment the drill has to itself."""
        rows = await ledger.rows(ctx.target, since)
        if rows is None or ctx.deployment is None:
            return [skipped("the gateway's counters match its ledger", "needs a spawned deployment")]
        statuses = Counter(r.status for r in rows)
        return [equal("ledger rows = requests the gateway finished (request_success_total)", len(rows),
                      int(success_after - success_before)),
                equal("cancelled rows = client cancellations counted", statuses["cancelled"], int(cancelled))]
