"""Drill 9: the gateway SIGKILLed under load, then started again on the same store.

What must hold: every response whose final chunk the client got has its ledger row (a completed request's row is
committed before its last chunk leaves), no row is doubled, no worker outlives the gateway that started it, and the
restarted gateway's quotas agree with the ledger: no concurrency slot survives the kill, and the token budget it
enforces is the one the ledger says is left.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from typing import Any, ClassVar

import trio

from chaos import ledger, procs
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS, worker_pids
from chaos.load import Outcome, RequestSpec
from chaos.target import set_quota, still_serves
from chaos.verdict import Check, DrillResult, check, equal, skipped

ORPHANS_GONE_WITHIN_S = 15.0  # a worker notices its gateway is gone within GATEWAY_GONE_S (5 s) or its parent's death
BUDGET_MARGIN = 40  # tokens left in the budget for the consistency probes


class GatewayKill(Drill):
    name = "gateway-kill"
    summary = ("SIGKILL the gateway under load and start it again: ledger rows equal responses that got their final "
               "chunk, none doubled; no orphaned workers; quotas consistent")
    needs_processes = True
    spawn_only = True  # it restarts the gateway
    SIZES: ClassVar[dict[bool, tuple[int, int, int]]] = {True: (16, 48, 64), False: (32, 160, 48)}

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        dep = ctx.deployment
        if dep is None:
            raise RuntimeError("gateway-kill needs a spawned deployment")
        concurrency, total, max_tokens = self.SIZES[ctx.sizing.quick]
        result.load = (f"{total} streams at concurrency {concurrency}, 24-token prompts, {max_tokens} tokens each; "
                       f"SIGKILL of the gateway once {concurrency // 2} have completed and as many stream")
        since = time.time()
        specs = [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 24), max_tokens), deadline_s=600.0)
                 for _ in range(total)]
        load = ctx.load(concurrency)
        workers = worker_pids(ctx)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run, specs)
            with trio.move_on_after(300):
                while (sum(1 for o in load.outcomes if o.kind == "completed") < concurrency // 2
                       or len(load.streaming) < concurrency // 2):  # strike with streams mid-flight
                    await trio.sleep(0.02)
            ctx.say(f"killing the gateway (pid {dep.gateway_pid}) with {load.in_flight} requests in flight")
            killed_at = trio.current_time()
            dep.kill(signal.SIGKILL)
            dep.reap()
            await load.wait_done(60.0)
        # Requests the load sent after the kill found no gateway (connection refused): not part of the drill.
        outcomes = [o for o in load.outcomes if o.kind != "not_sent" and o.started < killed_at]
        result.measurements["sent_after_the_kill"] = len(load.outcomes) - len(outcomes)
        record_outcomes(result, outcomes)
        left = await procs.wait_gone(workers, ORPHANS_GONE_WITHIN_S)
        result.add(check(f"no orphaned workers ({ORPHANS_GONE_WITHIN_S:g}s after the kill)", not left,
                         f"still alive: {left}" if left else f"{len(workers)} worker(s) gone"))
        result.add(equal("0 hung (every request ended when the gateway died)",
                         sum(1 for o in outcomes if o.kind == "hung"), 0))
        ctx.say("starting the gateway again on the same store")
        await dep.start()
        result.add(*await self._ledger(ctx, result, since, outcomes))
        result.add(*await quiet_checks(ctx, within=60.0))
        result.add(*await self._budget(ctx, since))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("serving after the restart", serves, how))

    async def _ledger(self, ctx: DrillContext, result: DrillResult, since: float,
                      outcomes: list[Outcome]) -> list[Check]:
        rows = await ledger.rows(ctx.target, since)
        if rows is None:
            return [skipped("ledger rows equal completed responses", "needs the local store")]
        ids = Counter(r.request_id for r in rows)
        done = {o.request_id for o in outcomes if o.kind == "completed" and o.request_id}
        completed_rows = {r.request_id for r in rows if r.status in ledger.COMPLETED_STATUSES}
        missing = done - set(ids)
        # Committed, then the gateway died before the last chunk left: by design (commit first), so counted.
        unseen = completed_rows - done
        cut = sum(1 for o in outcomes if o.kind in ("truncated", "transport"))
        result.measurements.update(completed_responses=len(done), ledger_rows=len(rows), cut_by_the_kill=cut,
                                   rows_committed_but_final_chunk_lost=len(unseen))
        return [
            check("every response that got its final chunk has its ledger row", not missing,
                  f"{len(missing)} missing of {len(done)}" if missing else f"{len(done)} of {len(done)}"),
            check("no ledger row doubled", all(n == 1 for n in ids.values()), f"{len(rows)} rows"),
            check("completed rows = completed responses (+ commits whose last chunk the kill cut)",
                  len(unseen) <= cut, f"{len(completed_rows)} rows, {len(done)} responses, {len(unseen)} committed "
                                      f"just before the kill ({cut} streams cut)"),
        ]

    async def _budget(self, ctx: DrillContext, since: float) -> list[Check]:
        """The restarted gateway seeds the tenant's budget from the ledger: with the budget set to what the ledger
        says was used plus a margin, a request that fits the margin is admitted and one that does not is refused
        with insufficient_quota."""
        name = "budget after the restart = what the ledger says is left"
        used = await _tenant_tokens(ctx, since)
        if used is None or not ctx.target.probe_key:
            return [skipped(name, "needs the local store and a probe key")]
        await set_quota(ctx.client, ctx.target, {"token_budget": used + BUDGET_MARGIN, "budget_period": "day"})
        fits = await _probe(ctx, BUDGET_MARGIN - 12)
        over = await _probe(ctx, BUDGET_MARGIN + 20)
        await set_quota(ctx.client, ctx.target, {"token_budget": None, "budget_period": None})
        ok = fits[0] == 200 and over == (429, "insufficient_quota")
        return [check(name, ok, f"ledger used {used} tokens; fitting request {fits[0]}, "
                                f"over-budget request {over[0]} {over[1] or ''}")]


async def _tenant_tokens(ctx: DrillContext, since: float) -> int | None:
    """Prompt + completion tokens of the whole drill tenant today (load and probe keys), from the ledger."""
    if ctx.target.tenant is None:
        return None
    body: Any = await ctx.target.admin(ctx.client, "GET", "/usage", params={"tenant": ctx.target.tenant,
                                                                             "since": "1d"})
    return sum(int(g["prompt_tokens"]) + int(g["completion_tokens"]) for g in body["data"])


async def _probe(ctx: DrillContext, cost: int) -> tuple[int, str | None]:
    """One request on the probe key costing ``cost`` tokens (8 prompt + the rest as max_tokens)."""
    body = ctx.completion(prompt_ids(ctx.rng, 8), cost - 8, stream=False)
    with trio.fail_after(60):
        r = await ctx.client.post(f"{ctx.target.url}/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {ctx.target.probe_key}"})
    code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
    return r.status_code, code
