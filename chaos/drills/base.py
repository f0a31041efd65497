"""What a drill is (plan, load, fault, observe, verdict) and what it is given to run.

A drill declares the deployment it wants (``spec``) and what it needs from the host (signals to processes, a
Redis it can stop, a store it can lock); ``run`` loads the deployment, injects its fault, observes and adds checks
to its ``DrillResult``. The runner gives it a ``DrillContext`` and bounds it in time.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from chaos import ledger, metrics
from chaos.deployment import Deployment, DeploymentSpec
from chaos.load import LoadGenerator, Outcome, RequestSpec, tally
from chaos.redis_proc import RedisProcess
from chaos.target import Target, slots_held
from chaos.verdict import Check, DrillResult, check, equal, skipped

DROPPED_STATUSES = frozenset({"cancelled"}) | ledger.COMPLETED_STATUSES


@dataclass(frozen=True)
class Sizing:
    quick: bool
    model: str  # what --model the spawned deployment serves ("tiny": a random-weight model made here)
    model_dir: str  # the path or alias actually passed to `kvgate serve --model`


@dataclass
class DrillContext:
    target: Target
    client: httpx.AsyncClient  # for probes, metrics and admin calls (the load has its own clients)
    sizing: Sizing
    rng: random.Random
    deployment: Deployment | None = None  # None against --url
    redis: RedisProcess | None = None
    gateway_pid: int | None = None  # known for spawned deployments and, when visible, for --url
    notes: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        """A progress line on stderr: drills take minutes and an operator wants to see where they are."""
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def load(self, concurrency: int) -> LoadGenerator:
        return LoadGenerator(self.target.url, self.target.api_key, concurrency)

    def completion(self, prompt: Any, max_tokens: int, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
        return {"model": self.target.model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                "temperature": 0, "ignore_eos": True, **extra}

    def chat(self, text: str, max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
        return {"model": self.target.model, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": stream, "temperature": 0, "ignore_eos": True}


class Drill:
    name: ClassVar[str]
    summary: ClassVar[str]
    needs_processes: ClassVar[bool] = False  # signals the gateway's or workers' processes (pids on this host)
    spawn_only: ClassVar[bool] = False  # restarts the gateway, owns Redis or the store: only with --spawn
    time_limit_s: ClassVar[tuple[float, float]] = (240.0, 1200.0)  # (quick, full) bound on the whole drill

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, torch_threads=1 if sizing.quick else None)

    async def prepare(self, workdir: Path) -> None:
        """Before a spawned deployment starts in ``workdir`` (e.g. mount something there)."""

    def cleanup(self, workdir: Path) -> None:
        """After the spawned deployment in ``workdir`` stopped: undo ``prepare``."""

    def quota(self, sizing: Sizing) -> dict[str, Any] | None:
        """The drill tenant's quota (a PUT /admin/.../quota body), or None for unlimited."""
        return None

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        raise NotImplementedError


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    """A prompt of ``n`` token ids, random so that no two requests share a cached prefix."""
    return [rng.randrange(100, 40_000) for _ in range(n)]


def plain_specs(route: str, bodies: Sequence[dict[str, Any]], deadline_s: float) -> list[RequestSpec]:
    return [RequestSpec(route, b, deadline_s) for b in bodies]


def record_outcomes(result: DrillResult, outcomes: Sequence[Outcome]) -> None:
    for kind, n in tally(outcomes).items():
        result.outcomes[kind] = result.outcomes.get(kind, 0) + n


async def quiet_checks(ctx: DrillContext, within: float) -> list[Check]:
    """After the fault: nothing running or waiting, no KV block held by a request, nothing tracked, no stream
    open, no concurrency slot held by the drill tenant."""
    quiet, took, snap = await metrics.wait_quiet(ctx.client, ctx.target.url, within)
    out = [check("quiet afterwards (running, waiting, KV, in flight, streams all 0)", quiet,
                 f"{metrics.quiet_detail(snap)} after {took:.1f}s")]
    held = await slots_held(ctx.client, ctx.target)
    out.append(skipped("0 concurrency slots held", "not observable: no admin token, or the probe was refused "
                                                    "for another reason") if held is None
               else equal("0 concurrency slots held", held, 0))
    return out


async def ledger_checks(ctx: DrillContext, since: float, outcomes: Sequence[Outcome]) -> list[Check]:
    """One ledger row per admitted request (a 200 came back); each request whose id the client saw has its row,
    completed ones with a completed status and dropped ones with ``cancelled``."""
    admitted = [o for o in outcomes if o.admitted]
    unknown = sum(1 for o in outcomes if o.kind == "dropped" and o.status is None)  # gone before any answer
    n = await ledger.settled_count(ctx.client, ctx.target, since, len(admitted))
    if n is None:
        return [skipped("one ledger row per admitted request", "ledger not readable without an admin token")]
    out = [check("one ledger row per admitted request", len(admitted) <= n <= len(admitted) + unknown,
                 f"{n} rows for {len(admitted)} admitted (+ up to {unknown} dropped before any answer)")]
    rows = await ledger.rows(ctx.target, since)
    if rows is None:
        return out
    by_id = {r.request_id: r for r in rows}
    wrong: list[str] = []
    for o in admitted:
        row = by_id.get(o.request_id or "")
        if o.request_id is None:
            continue
        if row is None:
            wrong.append(f"{o.request_id}: no row ({o.kind})")
        elif o.kind == "completed" and row.status not in ledger.COMPLETED_STATUSES:
            wrong.append(f"{o.request_id}: completed but row says {row.status}")
        elif o.kind == "dropped" and row.status not in DROPPED_STATUSES:
            # A stream can finish on the server while its client is still reading: then "length" is right.
            wrong.append(f"{o.request_id}: dropped but row says {row.status}")
    out.append(check("every row matches its response (completed / cancelled)", not wrong,
                     "; ".join(wrong[:5]) + (f" (+{len(wrong) - 5} more)" if len(wrong) > 5 else "")
                     if wrong else f"{sum(1 for o in admitted if o.request_id)} matched by request id"))
    return out
