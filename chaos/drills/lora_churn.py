"""Issue 25's drill: LoRA adapters registered and unregistered in a loop through the admin API while 16 streams run
against a mix of the base model and the adapters.

The deployment serves ``--lora-dir`` (random PEFT adapters written here for its model: ranks 4-16, attention or all
seven targets) with ``--max-loras 2 --max-cpu-loras 2``, so a worker's least recently used adapter is evicted and
read again all the time, and a step holds at most two adapters (the rest wait). The drill keeps the truth of the
registry on its side: a name is *registered* once its load answered 200, *unregistered* once its unload answered
200, and *in transition* while either is in flight; the load only picks settled names. Each request's answer is
judged against what the registry was from the moment the request was picked until its response headers came:

- a name settled the whole time: registered must complete (200 and ``[DONE]``), unregistered must be a 404
  ``model_not_found`` (the refusal any unknown name gets);
- a name that changed in that time may do either: its 404s are *expected refusals*, never failures;
- the base model must always complete.

Anything else is a failed stream (a 5xx, a transport error, a truncated or hung stream, an error event), which
must be 0, or, for a clean answer that contradicts a settled registry, a stale registry answer. The gateway reads
the registry at most once a second (``gateway/pipeline/adapters.py``; its own changes drop the snapshot at once): a
stale answer within that second of the name's last change is counted and shown as *late* (a catalog read that was
in flight across the change can keep the old table for its second), one later than that fails. Afterwards: every
worker's free KV blocks back to its total once idle (0 leaked), 0 worker restarts (the same pids, the supervisor's
restart and loss counters unchanged), the ledger matching the responses, quiet and no slots held.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, ledger_checks, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS, worker_pids
from chaos.load import Outcome, RequestSpec
from chaos.metrics import scrape
from chaos.target import ADMIN_TIMEOUT_S, still_serves
from chaos.verdict import DrillResult, check, equal
from tenancy.lora_check import BaseShapes

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTN, "gate_proj", "up_proj", "down_proj")
RESTARTS, LOST = "kvgate:worker_restarts_total", "kvgate:workers_lost_total"
# How late an answer may follow the registry: 0 against one gateway, whose admin routes invalidate its catalog
# before they answer (and a read that raced the write is not kept). Another gateway would see it within its 1 s.
CATALOG_TTL_S = 0.0
FREE_BLOCKS_WITHIN_S = 15.0  # a worker's Stats heartbeat carries its free blocks: a few heartbeats


@dataclass(frozen=True)
class Size:
    adapters: int  # directories under --lora-dir
    names: int  # names the churn registers and unregisters (each time pointed at a random directory)
    ops: int  # register/unregister operations
    pause_s: float  # between operations
    prompt: int
    max_tokens: int
    streams: int
    step_delay: str  # KVGATE_DEBUG_STEP_DELAY: the tiny model's steps take a millisecond; requests must span ops


@dataclass
class Op:
    name: str
    kind: str  # "load" or "unload"
    sent: float  # trio clock
    done: float = float("inf")  # answered (inf: never)
    status: int | None = None


@dataclass(frozen=True)
class Pick:
    model: str
    expect: str  # "base", "registered" or "unregistered": the name's settled state when the request was picked
    at: float


@dataclass
class Registry:
    """The drill's own truth about which names are registered, and every operation's interval."""

    registered: set[str] = field(default_factory=set)
    unregistered: set[str] = field(default_factory=set)
    ops: dict[str, list[Op]] = field(default_factory=dict)

    def changed(self, name: str, start: float, end: float) -> bool:
        """An operation on ``name`` was in flight at some moment of [start, end]."""
        return any(op.sent <= end and op.done >= start for op in self.ops.get(name, ()))

    def since_change(self, name: str, at: float) -> float:
        """Seconds from the last answered operation on ``name`` before ``at`` to ``at`` (inf: none)."""
        return at - max((op.done for op in self.ops.get(name, ()) if op.done <= at), default=-float("inf"))


@dataclass
class Verdicts:
    completed: int = 0
    adapter_completed: int = 0
    expected_refusals: int = 0  # 404 for a name that was being (un)registered meanwhile
    unregistered_refused: int = 0  # 404 for a name settled as unregistered (as it must be)
    stale: list[str] = field(default_factory=list)  # clean answers that contradict a settled registry
    late: list[str] = field(default_factory=list)  # the same within CATALOG_TTL_S of the name's last change
    failed: list[str] = field(default_factory=list)


class LoraChurn(Drill):
    name = "lora-churn"
    summary = ("LoRA adapters registered and unregistered in a loop through the admin API under 16 streams over the "
               "base model and the adapters: 0 failed streams (a 404 for a name being unregistered is an expected "
               "refusal), every answer as the registry was, 0 leaked KV blocks once idle, 0 worker restarts")
    spawn_only = True  # the deployment needs --lora-dir with adapters written for its model
    time_limit_s: ClassVar[tuple[float, float]] = (240.0, 900.0)
    SIZES: ClassVar[dict[bool, Size]] = {True: Size(6, 5, 80, 0.02, 16, 12, 16, "0.003"),
                                         False: Size(12, 8, 200, 0.1, 64, 32, 16, "")}

    def __init__(self) -> None:
        self.lora_root: Path | None = None
        self.model_dir = ""
        self.size = self.SIZES[True]

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        self.lora_root = Path(tempfile.mkdtemp(prefix="kvgate-chaos-loras-"))
        self.lora_root.chmod(0o755)
        self.model_dir, self.size = sizing.model_dir, self.SIZES[sizing.quick]
        delay = self.size.step_delay
        return DeploymentSpec(sizing.model_dir, torch_threads=1 if sizing.quick else None,
                              serve_args=("--lora-dir", str(self.lora_root), "--max-loras", "2",
                                          "--max-cpu-loras", "2"),
                              env=(("KVGATE_DEBUG_STEP_DELAY", delay),) if delay else ())

    async def prepare(self, workdir: Path) -> None:
        root, model_dir, n = self.lora_root, self.model_dir, self.size.adapters
        assert root is not None
        await trio.to_thread.run_sync(lambda: write_adapters(root, model_config(model_dir), n))

    def cleanup(self, workdir: Path) -> None:
        if self.lora_root is not None:
            shutil.rmtree(self.lora_root, ignore_errors=True)
            self.lora_root = None

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        size = self.size
        names = [f"churn-{i}" for i in range(size.names)]
        dirs = [f"a{i}" for i in range(size.adapters)]
        result.load = (f"{size.streams} streams back to back ({size.prompt}-token random prompts, {size.max_tokens} "
                       f"tokens each) over the base model and {size.names} adapter names; {size.ops} register/"
                       f"unregister operations {size.pause_s:g}s apart over {size.adapters} adapter directories "
                       "(--max-loras 2 --max-cpu-loras 2)")
        reg = Registry(unregistered=set(names))
        for name in names[: len(names) // 2]:
            await self._op(ctx, reg, name, "load", ctx.rng.choice(dirs))
        pids = worker_pids(ctx)
        before = await scrape(ctx.client, ctx.target.url)
        since = time.time()
        picks: list[Pick] = []
        stop = trio.Event()
        load = ctx.load(size.streams)

        def make_spec(n: int) -> RequestSpec:
            picks.append(self._pick(ctx, reg))
            body = ctx.completion(prompt_ids(ctx.rng, size.prompt), size.max_tokens)
            body["model"] = picks[-1].model
            return RequestSpec(COMPLETIONS, body, deadline_s=60.0)

        async with trio.open_nursery() as nursery:
            async def churn() -> None:
                try:
                    await self._churn(ctx, reg, names, dirs)
                finally:
                    stop.set()

            nursery.start_soon(churn)
            outcomes = await load.run_until(stop, make_spec)
        verdicts = judge(reg, picks, outcomes)
        ops = [op for ops in reg.ops.values() for op in ops]
        bad_ops = [f"{op.kind} {op.name}: {op.status}" for op in ops if op.status != 200]
        record_outcomes(result, outcomes)
        result.outcomes["expected_refusals"] = verdicts.expected_refusals
        ctx.say(f"{len(outcomes)} requests, {len(ops)} registry operations; {len(verdicts.failed)} failed")
        result.add(
            check("0 failed streams", not verdicts.failed,
                  f"{len(verdicts.failed)} failed: {'; '.join(verdicts.failed[:5])}" if verdicts.failed else
                  f"{verdicts.completed} completed ({verdicts.adapter_completed} on adapters), "
                  f"{verdicts.expected_refusals} expected refusals, {verdicts.unregistered_refused} refused as "
                  "unregistered"),
            check(f"every answer as the registry was, give or take the gateway's {CATALOG_TTL_S:g}s catalog (no 404 "
                  "for a settled registered name, no 200 for a settled unregistered one)", not verdicts.stale,
                  "; ".join(verdicts.stale[:5]) if verdicts.stale else
                  f"{len(picks)} answers judged, {len(verdicts.late)} late"
                  + (f" ({'; '.join(verdicts.late[:3])})" if verdicts.late else "")),
            check("requests completed on adapters, under the churn", verdicts.adapter_completed > 0,
                  f"{verdicts.adapter_completed} on adapters"),
            check("every register/unregister answered 200", not bad_ops,
                  "; ".join(bad_ops[:5]) if bad_ops else f"{len(ops)} operations"))
        result.add(*await quiet_checks(ctx, within=30.0))
        leaked, detail = await leaked_blocks(ctx)
        result.add(check("0 leaked KV blocks (free blocks back to the total once idle)", leaked == 0, detail))
        after = await scrape(ctx.client, ctx.target.url)
        restarts = after.total(RESTARTS) - before.total(RESTARTS)
        lost = after.total(LOST) - before.total(LOST)
        now = worker_pids(ctx)
        result.add(equal("0 worker restarts (supervisor's restart and loss counters)", int(restarts + lost), 0),
                   check("the same worker processes", sorted(now) == sorted(pids), f"before {pids}, after {now}"))
        result.add(*await ledger_checks(ctx, since, outcomes))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("serving afterwards", serves, how))
        result.measurements.update(
            requests=len(outcomes), failed_streams=len(verdicts.failed), stale_answers=len(verdicts.stale),
            late_answers=len(verdicts.late),
            expected_refusals=verdicts.expected_refusals, refused_unregistered=verdicts.unregistered_refused,
            adapter_completions=verdicts.adapter_completed, registry_ops=len(ops), leaked_blocks=leaked,
            worker_restarts=int(restarts + lost), adapter_loads_on_workers=worker_loads(ctx),
            lora_requests=int(after.total("kvgate:lora_requests_total")))

    def _pick(self, ctx: DrillContext, reg: Registry) -> Pick:
        now = trio.current_time()
        roll = ctx.rng.random()
        if roll < 0.25 or not (reg.registered or reg.unregistered):
            return Pick(ctx.target.model, "base", now)
        if roll < 0.85 and reg.registered:
            return Pick(ctx.rng.choice(sorted(reg.registered)), "registered", now)
        if reg.unregistered:
            return Pick(ctx.rng.choice(sorted(reg.unregistered)), "unregistered", now)
        return Pick(ctx.rng.choice(sorted(reg.registered)), "registered", now)

    async def _churn(self, ctx: DrillContext, reg: Registry, names: list[str], dirs: list[str]) -> None:
        for _ in range(self.size.ops):
            await trio.sleep(self.size.pause_s)
            low, high = len(reg.registered) <= 1, not reg.unregistered
            if high or (not low and ctx.rng.random() < 0.5):
                await self._op(ctx, reg, ctx.rng.choice(sorted(reg.registered)), "unload")
            else:
                await self._op(ctx, reg, ctx.rng.choice(sorted(reg.unregistered)), "load", ctx.rng.choice(dirs))

    async def _op(self, ctx: DrillContext, reg: Registry, name: str, kind: str, directory: str = "") -> None:
        """One register (to a directory; global or the drill tenant's, at random) or unregister, through the
        admin API; the name is in transition (neither set) while it is in flight."""
        reg.registered.discard(name)
        reg.unregistered.discard(name)
        op = Op(name, kind, trio.current_time())
        reg.ops.setdefault(name, []).append(op)
        body: dict[str, Any] = {"lora_name": name}
        if kind == "load":
            body["lora_path"] = directory
            if ctx.rng.random() < 0.5:
                body["tenant"] = ctx.target.tenant
        try:
            with trio.fail_after(ADMIN_TIMEOUT_S):
                r = await ctx.client.post(f"{ctx.target.url}/v1/{kind}_lora_adapter", json=body,
                                          headers=ctx.target.admin_headers)
            op.status = r.status_code
        except (httpx.TransportError, trio.TooSlowError):
            return  # never answered: the name stays in transition (any answer for it is acceptable)
        op.done = trio.current_time()
        if r.status_code == 200:
            (reg.registered if kind == "load" else reg.unregistered).add(name)


def judge(reg: Registry, picks: list[Pick], outcomes: list[Outcome], late_s: float = CATALOG_TTL_S) -> Verdicts:
    """Each request's answer against the registry while it ran (the module docstring says how); an answer that
    contradicts a name settled for at most ``late_s`` is late (reported), later than that stale (a failure)."""
    v = Verdicts()
    for pick, o in zip(picks, outcomes):
        end = o.headers_at if o.headers_at is not None else (o.ended_at or float("inf"))
        what = f"#{o.index} {pick.expect} {pick.model}: {o.kind} {o.status} {o.code}"
        completed = o.kind == "completed" and o.shape_ok
        not_found = o.kind == "rejected" and o.status == 404 and o.code == "model_not_found" and o.shape_ok
        if not (completed or not_found):
            v.failed.append(what)
            continue
        if pick.expect != "base" and reg.changed(pick.model, pick.at, end):
            if completed:
                v.completed += 1
                v.adapter_completed += 1
            else:
                v.expected_refusals += 1
        elif pick.expect == "unregistered" and not_found:
            v.unregistered_refused += 1
        elif pick.expect == "base" and not completed:
            v.failed.append(what)
        elif pick.expect == "unregistered" or not completed:
            since = reg.since_change(pick.model, end)
            (v.late if since <= late_s else v.stale).append(f"{what}, {since:.3f}s after its last change")
        else:
            v.completed += 1
            v.adapter_completed += pick.expect == "registered"
    return v


async def leaked_blocks(ctx: DrillContext) -> tuple[int, str]:
    """Blocks not free on any worker once idle (waits up to FREE_BLOCKS_WITHIN_S for a fresh heartbeat), and a
    detail line; -1 when the workers' stats cannot be read."""
    detail = "no worker stats"
    leaked = -1
    with trio.move_on_after(FREE_BLOCKS_WITHIN_S):
        while True:
            with trio.fail_after(ADMIN_TIMEOUT_S):
                r = await ctx.client.get(f"{ctx.target.url}/admin/workers", headers=ctx.target.admin_headers)
            rows = r.json().get("data", []) if r.status_code == 200 else []
            stats = [row.get("stats") or {} for row in rows]
            if stats and all("num_free_blocks" in s for s in stats):
                leaked = sum(int(s["num_total_blocks"]) - int(s["num_free_blocks"]) for s in stats)
                detail = ", ".join(f"{row.get('worker')}: {s['num_free_blocks']}/{s['num_total_blocks']} free"
                                   for row, s in zip(rows, stats))
                if leaked == 0:
                    break
            await trio.sleep(0.25)
    return leaked, detail


def worker_loads(ctx: DrillContext) -> int | None:
    """Adapters the workers read from disk (their "LoRA adapter ... loaded" log lines): the LRU at work."""
    if ctx.deployment is None:
        return None
    return sum(1 for line in ctx.deployment.log_text().splitlines() if "LoRA adapter" in line and " loaded:" in line)


# --- the adapters -----------------------------------------------------------------------------------------------

def model_config(model_dir: str) -> dict[str, Any]:
    """The base model's config.json (an alias or a GGUF is converted first, as the tiny model's tokenizer is)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from workers.model_files import resolve

        path = resolve(model_dir).directory
    cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    return cfg


def write_adapters(root: Path, cfg: dict[str, Any], n: int, seed: int = 0) -> list[Path]:
    """``n`` random PEFT LoRA adapters for a Llama ``cfg``, as PEFT saves them (``a0``..): ranks 4, 8, 16 in turn,
    attention targets or all seven; B is random too (PEFT starts it at zero, which would be the base model)."""
    import numpy as np
    from safetensors.numpy import save_file

    base = BaseShapes.from_config(cfg)
    shapes = base.targets()  # PEFT module -> (parent module, out features, in features)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r, targets = (4, 8, 16)[i % 3], ALL if i % 2 else ATTN
        tensors = {}
        for layer in range(base.layers):
            for t in targets:
                parent, fan_out, fan_in = shapes[t]
                key = f"base_model.model.model.layers.{layer}.{parent}.{t}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, fan_in)) * 0.05).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, r)) * 0.05).astype(np.float32)
        d = root / f"a{i}"
        d.mkdir(parents=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
            "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "use_dora": False,
            "use_rslora": False, "base_model_name_or_path": None}))
        out.append(d)
    return out
