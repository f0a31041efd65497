"""Drill 7: Redis stopped and restarted under load, with two gateways sharing it (and one store): gateway A fails
closed (the default), gateway B was started with ``--redis-fail-open``.

During the outage A must answer 503 with retry-after (never a 500) and B must admit; once Redis is back (empty, as
a restarted Redis without persistence is) A serves again and the tenant's rate limit holds again across both
gateways: a burst past ``rpm`` is refused with 429 and retry-after.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import trio

from chaos.deployment import Deployment, DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS
from chaos.load import LoadGenerator, Outcome, RequestSpec
from chaos.redis_proc import RedisProcess
from chaos.verdict import Check, DrillResult, check

RPM = 40  # the drill tenant's requests per minute: far above the outage load's pace, well below the burst
BURST = RPM + 30
RECOVERY_WITHIN_S = 30.0


def _refusals_ok(outcomes: list[Outcome]) -> bool:
    return all(o.retry_after and o.retry_after.isdigit() for o in outcomes if o.status in (429, 503))


def _statuses(outcomes: list[Outcome]) -> str:
    counts = Counter(f"{o.status or o.kind}{':' + o.code if o.code and o.status != 200 else ''}" for o in outcomes)
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


class RedisOutage(Drill):
    name = "redis-outage"
    summary = ("Redis stopped and restarted under load with --redis-url: fail-closed answers 503 with retry-after, "
               "fail-open admits, nothing 500s, limits hold again once it is back")
    spawn_only = True  # it owns the Redis it stops
    OUTAGE_S: ClassVar[dict[bool, float]] = {True: 6.0, False: 30.0}

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, redis=True, torch_threads=1 if sizing.quick else None)

    def quota(self, sizing: Sizing) -> dict[str, int] | None:
        return {"rpm": RPM}

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        if ctx.deployment is None or ctx.redis is None:
            raise RuntimeError("redis-outage needs a spawned deployment with its own Redis")
        outage = self.OUTAGE_S[ctx.sizing.quick]
        result.load = (f"gateway A fail-closed + gateway B --redis-fail-open on one Redis and store; tenant rpm {RPM}; "
                       f"Redis down {outage:g}s under 1 request/s per gateway; then a burst of {BURST} over both")
        twin = ctx.deployment.sibling(("--redis-fail-open",))
        try:
            await twin.start()
            await self._drill(ctx, result, twin, ctx.redis, outage)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(twin.stop)

    async def _drill(self, ctx: DrillContext, result: DrillResult, twin: Deployment, redis: RedisProcess,
                     outage: float) -> None:
        closed, opened = ctx.load(4), LoadGenerator(twin.url, ctx.target.api_key, 4)
        before = await self._paced(ctx, [closed, opened], 3, 0.5)
        ctx.say(f"stopping Redis for {outage:g}s")
        redis.stop()
        during = await self._paced(ctx, [closed, opened], int(outage), 1.0)
        ctx.say("starting Redis again (empty)")
        await redis.start()
        recovered = await self._recovery(ctx)
        burst = await self._burst(ctx, twin)
        record_outcomes(result, [*before[0], *before[1], *during[0], *during[1], *burst])
        result.add(*self._verdict(before, during, burst, recovered))
        result.measurements["recovered_after_s"] = None if recovered is None else round(recovered, 1)
        result.add(*await quiet_checks(ctx, within=60.0))

    async def _paced(self, ctx: DrillContext, loads: list[LoadGenerator], n: int,
                     interval: float) -> list[list[Outcome]]:
        """``n`` small requests per gateway, one every ``interval`` s, all gateways in step."""
        out: list[list[Outcome]] = [[] for _ in loads]
        async with trio.open_nursery() as nursery:
            for i, load in enumerate(loads):
                async def one_gateway(i: int = i, load: LoadGenerator = load) -> None:
                    for _ in range(n):
                        spec = RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 8), 4, stream=False), 60.0)
                        out[i] += await load.run([spec])
                        await trio.sleep(interval)
                nursery.start_soon(one_gateway)
        return out

    async def _recovery(self, ctx: DrillContext) -> float | None:
        """Seconds until the fail-closed gateway admits again (None: not within RECOVERY_WITHIN_S)."""
        start = trio.current_time()
        with trio.move_on_after(RECOVERY_WITHIN_S):
            while True:
                [o] = await ctx.load(1).run([RequestSpec(COMPLETIONS, ctx.completion("ping", 1, stream=False), 30.0)])
                if o.status == 200:
                    return trio.current_time() - start
                await trio.sleep(0.5)
        return None

    async def _burst(self, ctx: DrillContext, twin: Deployment) -> list[Outcome]:
        specs = [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 8), 1, stream=False), 120.0)
                 for _ in range(BURST // 2)]
        async with trio.open_nursery() as nursery:
            a, b = ctx.load(16), LoadGenerator(twin.url, ctx.target.api_key, 16)
            nursery.start_soon(a.run, specs)
            nursery.start_soon(b.run, specs)
        return [*a.outcomes, *b.outcomes]

    def _verdict(self, before: list[list[Outcome]], during: list[list[Outcome]], burst: list[Outcome],
                 recovered: float | None) -> list[Check]:
        everything = [*before[0], *before[1], *during[0], *during[1], *burst]
        server_errors = [o for o in everything if o.status is not None and o.status >= 500 and o.status != 503]
        closed, opened = during
        admitted = sum(1 for o in burst if o.status == 200)
        allowance = RPM + 5  # the bucket refills rpm/60 per second while the burst runs
        return [
            check("before the outage: both gateways admit", all(o.status == 200 for o in before[0] + before[1]),
                  _statuses(before[0] + before[1])),
            check("fail-closed during the outage: 503 with retry-after (no other answer)",
                  bool(closed) and all(o.status == 503 for o in closed) and _refusals_ok(closed), _statuses(closed)),
            check("fail-open during the outage: admits", bool(opened) and all(o.status == 200 for o in opened),
                  _statuses(opened)),
            check("nothing 500s (no 5xx but 503, no transport error, no hang)",
                  not server_errors and all(o.clean for o in everything), _statuses(server_errors) or "none"),
            check(f"fail-closed gateway serves again within {RECOVERY_WITHIN_S:g}s of Redis' return",
                  recovered is not None, "never" if recovered is None else f"after {recovered:.1f}s"),
            check(f"limits hold again: a burst of {BURST} over both gateways admits at most rpm {RPM} (+5 refill)",
                  admitted <= allowance and any(o.status == 429 for o in burst) and _refusals_ok(burst),
                  f"{admitted} admitted; {_statuses(burst)}"),
        ]
