"""Running drills: one fresh deployment per drill (``--spawn``) or the running one at ``--url``, each drill bounded
in time, every exception turned into a failed verdict that says what broke, and nothing left running after.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from chaos import procs
from chaos.deployment import Deployment
from chaos.drills.base import Drill, DrillContext, Sizing
from chaos.redis_proc import RedisProcess
from chaos.target import Target, provision, served_model
from chaos.verdict import DrillResult


@dataclass(frozen=True)
class RunOptions:
    quick: bool = False
    model: str | None = None  # None: "tiny" for --quick, "smollm2" otherwise
    url: str | None = None  # None: spawn a deployment per drill
    api_key: str | None = None
    admin_token: str | None = None
    keep: bool = False  # keep the spawned deployments' directories (logs, store) for a post-mortem
    seed: int = 0

    def __post_init__(self) -> None:
        if self.url is not None and not procs.is_loopback_url(self.url):
            raise ValueError(f"drills run only against loopback addresses, not {self.url!r}")
        if self.url is not None and not (self.api_key or self.admin_token):
            raise ValueError("--url needs --admin-token (to provision a drill tenant) or --api-key")

    def sizing(self) -> Sizing:
        model = self.model or ("tiny" if self.quick else "smollm2")
        if model == "tiny":
            from chaos.tiny_model import tiny_model_dir

            return Sizing(self.quick, model, str(tiny_model_dir()))
        return Sizing(self.quick, model, model)


async def run_drills(drills: Sequence[Drill], options: RunOptions,
                     on_result: Callable[[DrillResult], None] | None = None) -> list[DrillResult]:
    """Each drill in turn (``on_result`` sees each verdict as soon as it is in: full runs take a while)."""
    sizing = await trio.to_thread.run_sync(options.sizing) if options.url is None else Sizing(options.quick, "", "")
    results = []
    for drill in drills:
        results.append(await run_drill(drill, options, sizing))
        if on_result is not None:
            on_result(results[-1])
    return results


async def run_drill(drill: Drill, options: RunOptions, sizing: Sizing) -> DrillResult:
    result = DrillResult(drill.name, "quick" if options.quick else "full")
    if options.url is not None and drill.spawn_only:
        result.not_run = "needs a deployment of its own (no --url): it restarts or breaks what it runs on"
        return result
    started = trio.current_time()
    deployment: Deployment | None = None
    try:
        with trio.fail_after(drill.time_limit_s[0 if options.quick else 1]):
            async with _context(drill, options, sizing) as ctx:
                deployment = ctx.deployment
                await drill.run(ctx, result)
    except trio.TooSlowError:
        result.error = f"the drill ran past its time limit ({drill.time_limit_s[0 if options.quick else 1]:.0f}s)"
    except Exception as e:  # noqa: BLE001 - a broken drill is a failed verdict with its reason, not a crash
        result.error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    result.seconds = round(trio.current_time() - started, 1)
    if deployment is not None and not result.passed:
        result.log_tail = deployment.log_tail(3000)
    return result


@asynccontextmanager
async def _context(drill: Drill, options: RunOptions, sizing: Sizing) -> AsyncIterator[DrillContext]:
    rng = random.Random(f"{options.seed}:{drill.name}")
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        if options.url is not None:
            target = await _url_target(client, options, drill.quota(sizing))
            pid = procs.listening_pid(options.url)
            if drill.needs_processes and pid is None:
                raise RuntimeError("cannot see the gateway's process on this host: signals need its pid")
            yield DrillContext(target, client, sizing, rng, gateway_pid=pid)
            return
        async with _spawned(drill, options, sizing, client, rng) as ctx:
            yield ctx


async def _url_target(client: httpx.AsyncClient, options: RunOptions, quota: dict[str, Any] | None) -> Target:
    url = (options.url or "").rstrip("/")
    if options.admin_token:
        return await provision(client, url, options.admin_token, quota=quota)
    target = Target(url, options.api_key or "")
    target.model = await served_model(client, url, target.api_key)
    return target


@asynccontextmanager
async def _spawned(drill: Drill, options: RunOptions, sizing: Sizing, client: httpx.AsyncClient,
                   rng: random.Random) -> AsyncIterator[DrillContext]:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvgate-chaos-{drill.name}-"))
    spec = drill.spec(sizing)
    redis = RedisProcess(workdir / "redis") if spec.redis else None
    deployment: Deployment | None = None
    try:
        await drill.prepare(workdir)
        if redis is not None:
            await redis.start()
        deployment = Deployment(spec, workdir, redis.url if redis is not None else None)
        await deployment.start()
        target = await provision(client, deployment.url, deployment.admin_token, deployment.db_path,
                                 drill.quota(sizing))
        yield DrillContext(target, client, sizing, rng, deployment, redis, deployment.gateway_pid)
    finally:
        with trio.CancelScope(shield=True):
            if deployment is not None:
                await trio.to_thread.run_sync(deployment.stop)
            if redis is not None:
                redis.stop()
            drill.cleanup(workdir)
        if options.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
