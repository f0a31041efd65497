"""``kvgatectl worker``: list a gateway's workers, drain one, restart them one at a time (remote mode only: the
gateway's ``/admin/workers`` API with its admin token).

A drained worker takes no new request, finishes its own, exits, and its supervisor starts a fresh one with the
same id. ``restart`` drains the workers one after another and waits for each fresh process to be ready (listed
again under its id, with a new pid, not draining) before draining the next, so the others carry the load
meanwhile: a rolling restart (after a code or model upgrade on disk) that fails no request. Workers started by
hand (``kvgate worker``) exit when drained and come back only if their own process manager restarts them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer

from console.admin_client import RemoteAdmin
from tenancy.admin_ops import AdminOpError, Json

worker_app = typer.Typer(help="List, drain and restart a gateway's workers (needs --url and --admin-token).",
                         no_args_is_help=True)

TimeoutOpt = Annotated[float | None, typer.Option(
    "--timeout", min=0, max=3600, help="Seconds a draining worker's requests may run before they are cut "
    "(default: the gateway's --drain-timeout).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
POLL_S = 0.5


def _remote(ctx: typer.Context) -> RemoteAdmin:
    settings: Any = ctx.find_root().obj  # console.kvgatectl.Settings (not imported: that module registers this one)
    url, token = getattr(settings, "url", None), getattr(settings, "admin_token", None)
    if not url or not token:
        raise typer.BadParameter("worker commands talk to a gateway: give --url and --admin-token "
                                 "(or KVGATE_URL and KVGATE_ADMIN_TOKEN)", param_hint="--url")
    return RemoteAdmin(url, token)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _rows(admin: RemoteAdmin) -> dict[str, dict[str, Any]]:
    return {str(r["worker"]): r for r in admin.workers().get("data", [])}


def wait_replaced(admin: RemoteAdmin, worker_id: str, old_pid: int, within: float,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Poll until ``worker_id`` is listed ready with a pid other than ``old_pid``; its row. AdminOpError after
    ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        row = _rows(admin).get(worker_id)
        if row is not None and row["hello"]["pid"] != old_pid and row.get("state") == "ready":
            return row
        if time.monotonic() > deadline:
            raise AdminOpError(0, f"worker {worker_id} was not back (ready, new pid) within {within:g}s; a worker "
                                  "started by hand needs its own process manager to restart it", code="timeout")
        sleep(POLL_S)


def roll(admin: RemoteAdmin, worker_ids: list[str], timeout: float | None, within: float,
         say: Callable[[str], None]) -> list[Json]:
    """Drain ``worker_ids`` one at a time, each time waiting for the fresh process. One result per worker."""
    results: list[Json] = []
    for wid in worker_ids:
        started = time.monotonic()
        drained = admin.drain_worker(wid, timeout)
        say(f"{wid}: draining (pid {drained['pid']}, {drained['in_flight']} requests in flight, "
            f"timeout {drained['timeout']:g}s)")
        row = wait_replaced(admin, wid, int(drained["pid"]), within + float(drained["timeout"]))
        took = round(time.monotonic() - started, 1)
        say(f"{wid}: back as pid {row['hello']['pid']} after {took:g}s")
        results.append({"worker": wid, "old_pid": drained["pid"], "new_pid": row["hello"]["pid"],
                        "in_flight_at_drain": drained["in_flight"], "seconds": took})
    return results


@worker_app.command("list")
def worker_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """The gateway's live workers: id, state (ready or draining), pid, requests in flight."""
    try:
        with _remote(ctx) as admin:
            data = admin.workers()
    except AdminOpError as e:
        return _fail(e.message)
    if json_out or getattr(ctx.find_root().obj, "json", False):
        typer.echo(json.dumps(data, indent=2))
        return
    for r in data.get("data", []):
        typer.echo(f"{r['worker']}\t{r.get('state', 'ready')}\tpid {r['hello']['pid']}\t{r['in_flight']} in flight")


@worker_app.command("drain")
def worker_drain(ctx: typer.Context, worker_id: Annotated[str, typer.Argument(help="The worker's id (e.g. w0).")],
                 timeout: TimeoutOpt = None,
                 wait: Annotated[bool, typer.Option("--wait", help="Wait until the fresh process is ready.")] = False,
                 within: Annotated[float, typer.Option(min=1, help="With --wait: seconds the fresh process may take "
                                                               "to start (on top of --timeout).")] = 300.0,
                 json_out: JsonOpt = False) -> None:
    """Drain one worker: it takes nothing new, finishes its requests, exits, and its supervisor replaces it."""
    try:
        with _remote(ctx) as admin:
            if wait:
                result: Json = roll(admin, [worker_id], timeout, within, lambda line: typer.echo(line, err=True))[0]
            else:
                result = admin.drain_worker(worker_id, timeout)
    except AdminOpError as e:
        return _fail(e.message)
    typer.echo(json.dumps(result, indent=2) if json_out or not wait else
               f"{worker_id} restarted: pid {result['old_pid']} -> {result['new_pid']}")


@worker_app.command("restart")
def worker_restart(ctx: typer.Context,
                   worker_ids: Annotated[list[str] | None, typer.Argument(help="Workers to restart, in order.")] = None,
                   all_: Annotated[bool, typer.Option("--all", help="Every live worker, in id order.")] = False,
                   timeout: TimeoutOpt = None,
                   within: Annotated[float, typer.Option(min=1, help="Seconds each fresh process may take to "
                                                                 "start (on top of --timeout).")] = 300.0,
                   json_out: JsonOpt = False) -> None:
    """Rolling restart: drain the workers one at a time, each after the previous one's fresh process is ready."""
    if bool(worker_ids) == all_:
        raise typer.BadParameter("give worker ids or --all (not both)")
    try:
        with _remote(ctx) as admin:
            ids = sorted(_rows(admin)) if all_ else list(worker_ids or [])
            if not ids:
                return _fail("the gateway has no live worker to restart")
            results = roll(admin, ids, timeout, within, lambda line: typer.echo(line, err=True))
    except AdminOpError as e:
        return _fail(e.message)
    if json_out:
        typer.echo(json.dumps({"object": "list", "data": results}, indent=2))
    else:
        typer.echo(f"restarted {len(results)} worker(s): " + ", ".join(
            f"{r['worker']} pid {r['old_pid']} -> {r['new_pid']}" for r in results))
