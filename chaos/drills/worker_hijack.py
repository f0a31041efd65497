"""Worker hijack: a peer holding another listed CURVE key tries to become a serving worker.

The deployment runs its worker socket with CURVE (``--worker-keys``, ``--server-secret-key``): keys ``good`` and
``other`` are listed, ``intruder`` is not. Two workers serve: the gateway's own ``w0`` (the key it makes for its
local workers) and ``good``, started by the drill with key ``good``, as README's "Remote workers with CURVE" says.
While a steady load runs, peers with key ``other`` connect again and again, each presenting a victim's worker id
as its ZeroMQ routing id (the name a ROUTER would once have handed that worker's prompts to), saying Hello as the
victim (``good``, ``w0``, or ``good/evil`` in good's namespace) and then Goodbye in its name; peers with the
unlisted key do the same. (A worker's real routing id is 128 random bits of its socket, never its id.)

Verdict: every listed-key attempt is sent one Refused (naming what key ``other`` may serve) and nothing else, no
prompt, no ping; every unlisted-key attempt is sent nothing at all; both real workers keep their ids and pids and
go on serving (none lost, each serves requests during the attack, every request of the load completes); the
gateway logs each refusal with the peer's key (Z85) and the name of its key file, and each unlisted key once.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import trio
import zmq

from chaos import curve_peer
from chaos.deployment import Deployment, DeploymentSpec, free_port
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS
from chaos.load import Outcome, RequestSpec
from chaos.metrics import Snapshot, scrape
from chaos.procs import alive, stop_process
from chaos.target import still_serves
from chaos.verdict import Check, DrillResult, check, equal
from ipc.curve import create_key_files, load_public_key

KEYS, ALLOWED = "keys", "allowed-workers"  # in the deployment's directory (the gateway's working directory)
LISTED, UNLISTED = ("good", "other"), ("intruder",)
VICTIMS = ("good", "w0", "good/evil")
WORKER_START_S = 240.0
LOST = "kvgate:workers_lost_total"
SUCCESS = "vllm:request_success_total"


class WorkerHijack(Drill):
    name = "worker-hijack"
    summary = ("with CURVE worker keys, a peer holding another listed key connects under a serving worker's id "
               "(routing id and Hello) and says Goodbye in its name: refused every time and told why, nothing else "
               "sent to it, the real workers keep serving, each refusal logged with the peer's key name")
    spawn_only = True  # it sets the deployment's keys and worker socket
    needs_processes = True
    time_limit_s: ClassVar[tuple[float, float]] = (420.0, 900.0)
    ATTEMPTS: ClassVar[dict[bool, int]] = {True: 24, False: 150}  # listed-key attempts (unlisted: a quarter)

    def __init__(self) -> None:
        self.zmq_port = 0

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        from chaos.tiny_model import tiny_model_dir

        self.zmq_port = free_port()
        # The model serves only the load that proves the workers still serve: the tiny one at both sizes.
        return DeploymentSpec(str(tiny_model_dir()), torch_threads=1, serve_args=(
            "--zmq-bind", f"tcp://127.0.0.1:{self.zmq_port}", "--worker-keys", ALLOWED,
            "--server-secret-key", f"{KEYS}/gateway.key_secret"))

    async def prepare(self, workdir: Path) -> None:
        def make() -> None:
            for name in ("gateway", *LISTED, *UNLISTED):
                create_key_files(workdir / KEYS, name)
            (workdir / ALLOWED).mkdir()
            for name in LISTED:  # only public halves are listed, as an operator copies them
                (workdir / ALLOWED / f"{name}.key").write_bytes((workdir / KEYS / f"{name}.key").read_bytes())

        await trio.to_thread.run_sync(make)

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        if ctx.deployment is None:  # spawn_only: the runner never gets here without one
            raise RuntimeError("worker-hijack needs its own deployment")
        n = self.ATTEMPTS[ctx.sizing.quick]
        result.load = (f"{n} hijack attempts with listed key 'other' and {n // 4} with unlisted key 'intruder' "
                       f"({len(VICTIMS)} at a time) claiming worker ids {', '.join(VICTIMS)}, beside 4 clients "
                       "sending short completions back to back to two workers (local w0, remote good)")
        workdir = ctx.deployment.workdir
        good = self._start_good(ctx.deployment)
        try:
            await self._wait_workers(ctx, {"good", "w0"}, good)
            before_workers = await self._workers(ctx)
            before = await scrape(ctx.client, ctx.target.url)
            attempts, outcomes = await self._attack(ctx, workdir, n)
            after_workers = await self._workers(ctx)
            after = await scrape(ctx.client, ctx.target.url)
            record_outcomes(result, outcomes)
            result.add(*self._refusals(result, attempts))
            result.add(*self._workers_kept(result, before_workers, after_workers, before, after, good))
            result.add(*self._logged(ctx, workdir))
            failed = [o for o in outcomes if o.kind != "completed"]
            result.add(check("every request of the load completed during the attack", bool(outcomes) and not failed,
                             f"{len(outcomes) - len(failed)} of {len(outcomes)}"))
            serves, how = await still_serves(ctx.client, ctx.target)
            result.add(check("still serving afterwards", serves, how))
            result.add(*await quiet_checks(ctx, within=60.0))
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(stop_process, good)

    def _start_good(self, deployment: Deployment) -> subprocess.Popen[bytes]:
        """``kvgate worker`` with key ``good`` (the README's remote worker), on this host, in the deployment's
        directory (its key paths are relative to it) and environment (the store's secret, the torch threads)."""
        cmd = [sys.executable, "-m", "console.kvgate", "worker", "--connect", f"tcp://127.0.0.1:{self.zmq_port}",
               "--worker-id", "good", "--model", deployment.spec.model, "--served-model-name",
               deployment.spec.served_name, "--key", f"{KEYS}/good.key_secret",
               "--server-key", f"{KEYS}/gateway.key", "--log-format", "text"]
        with (deployment.workdir / "worker-good.log").open("ab") as log:
            return subprocess.Popen(cmd, cwd=deployment.workdir, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=deployment.env())

    async def _workers(self, ctx: DrillContext) -> dict[str, int]:
        """Worker id -> pid, as the gateway lists them."""
        body = await ctx.target.admin(ctx.client, "GET", "/workers")
        return {w["hello"]["worker_id"]: int(w["hello"]["pid"]) for w in body["data"]}

    async def _wait_workers(self, ctx: DrillContext, ids: set[str], good: subprocess.Popen[bytes]) -> None:
        with trio.fail_after(WORKER_START_S):
            while not ids <= set(await self._workers(ctx)):
                if good.poll() is not None:  # no point waiting out the bound: say why it went
                    raise RuntimeError(f"worker 'good' exited with {good.returncode} before it joined (see "
                                       "worker-good.log in the deployment's directory, --keep)")
                await trio.sleep(0.5)

    async def _attack(self, ctx: DrillContext, workdir: Path,
                      n: int) -> tuple[list[curve_peer.Attempt], list[Outcome]]:
        """The attempts (in threads, one per claimed id at a time) while four clients keep two workers busy."""
        plan = [("other", VICTIMS[i % len(VICTIMS)], True) for i in range(n)]
        plan += [("intruder", VICTIMS[i % len(VICTIMS)], False) for i in range(n // 4)]
        connect, model, keys = f"tcp://127.0.0.1:{self.zmq_port}", ctx.target.model, workdir / KEYS
        attempts: list[curve_peer.Attempt] = []
        # One attempt per claimed id at a time: two peers presenting the same routing id at once take each other's
        # replies over (ROUTER_HANDOVER), which says nothing about the real worker, whose routing id is secret.
        locks = {v: trio.Lock() for v in VICTIMS}
        zctx: zmq.Context[Any] = zmq.Context()
        load, stop = ctx.load(4), trio.Event()

        def spec(i: int) -> RequestSpec:
            return RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 8), 8, stream=i % 2 == 0), 120.0)

        async def one(key: str, victim: str, listed: bool) -> None:
            async with locks[victim]:
                attempts.append(await trio.to_thread.run_sync(curve_peer.attempt, zctx, connect, keys, key, victim,
                                                              model, listed))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load.run_until, stop, spec)
                async with trio.open_nursery() as attackers:
                    for key, victim, listed in plan:
                        attackers.start_soon(one, key, victim, listed)
                stop.set()  # what is in flight runs to its end
        finally:
            zctx.term()  # every socket was closed with linger 0 by its attempt
        return attempts, load.outcomes

    def _refusals(self, result: DrillResult, attempts: list[curve_peer.Attempt]) -> list[Check]:
        listed = [a for a in attempts if a.key_name == "other"]
        unlisted = [a for a in attempts if a.key_name != "other"]
        told = Counter(r for a in listed for r in a.refusals)
        result.measurements["attempts_listed_key"] = len(listed)
        result.measurements["attempts_refused"] = sum(1 for a in listed if a.refused_only)
        result.measurements["attempts_unlisted_key"] = len(unlisted)
        result.measurements["attempts_unlisted_silent"] = sum(1 for a in unlisted if a.silent)
        result.measurements["refusal_reasons"] = "; ".join(f"{r} x{k}" for r, k in told.most_common(3))
        leaked = Counter(f for a in attempts for f in a.other_frames)
        errors = [a.error for a in attempts if a.error]
        return [equal("listed key: every attempt refused, told why once, sent nothing else",
                      sum(1 for a in listed if a.refused_only), len(listed)),
                check("the refusal names what key 'other' may serve",
                      bool(told) and all("key other may serve worker ids other and other/*" in r for r in told),
                      next(iter(told), "no refusal")),
                equal("unlisted key: every attempt sent nothing at all", sum(1 for a in unlisted if a.silent),
                      len(unlisted)),
                check("no frame but Refused ever reached a peer (no prompt, no ping)", not leaked and not errors,
                      ", ".join(f"{k} x{v}" for k, v in leaked.items()) or (errors[0] if errors else "none"))]

    def _workers_kept(self, result: DrillResult, before: dict[str, int], after: dict[str, int],
                      snap_before: Snapshot, snap_after: Snapshot, good: subprocess.Popen[bytes]) -> list[Check]:
        served = {w: snap_after.by_label(SUCCESS, "worker").get(w, 0.0) -
                  snap_before.by_label(SUCCESS, "worker").get(w, 0.0) for w in before}
        served_text = ", ".join(f"{w}: {v:g}" for w, v in served.items())
        result.measurements["requests_served_during_attack"] = served_text
        lost = snap_after.total(LOST) - snap_before.total(LOST)
        return [equal("the same workers with the same pids before and after", after, before),
                check("both real workers alive and none lost", good.poll() is None and lost == 0
                      and all(alive(p) for p in after.values()), f"workers lost {lost:g}, good "
                      f"{'running' if good.poll() is None else f'exited {good.returncode}'}"),
                check("each real worker served requests during the attack", all(v > 0 for v in served.values()),
                      served_text)]

    def _logged(self, ctx: DrillContext, workdir: Path) -> list[Check]:
        """The gateway's log names the peer's key (Z85) and its key file's name for each refused Hello (once per
        key and claimed id), and the unlisted key it refused at the handshake."""
        log = ctx.deployment.log_text() if ctx.deployment is not None else ""
        other = load_public_key(workdir / KEYS / "other.key").decode()
        intruder = load_public_key(workdir / KEYS / "intruder.key").decode()
        lines = [ln for ln in log.splitlines() if "refused a Hello" in ln]
        named = [v for v in VICTIMS if any(f"key {other} may not serve as worker {v} (key other may serve" in ln
                                           for ln in lines)]
        return [check("each refused Hello logged with the peer's key and its name ('other')", named == list(VICTIMS),
                      f"{len(lines)} 'refused a Hello' lines; logged for {', '.join(named) or 'none'}"),
                check("the unlisted key's refusal logged with its key",
                      f"refused a worker: public key {intruder}" in log, intruder[:12] + "...")]

