"""``kvgate chaos``: list the drills, run some, print a verdict table, write ``--json-out``, exit 1 on a failure.

Exit codes: 0 every verdict passed, 1 a verdict failed (or a drill could not run), 2 bad usage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import trio
import typer
from rich.console import Console
from rich.table import Table

from chaos.drills import all_drills, by_name
from chaos.runner import RunOptions, run_drills
from chaos.verdict import DrillResult, machine

app = typer.Typer(help="Drills that break a live kvgate deployment on purpose and report what survived.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
_VERDICT_STYLE = {"PASS": "[green]PASS[/]", "FAIL": "[red]FAIL[/]", "SKIP": "[yellow]SKIP[/]"}


@app.command("list")
def list_drills() -> None:
    """The drills and the verdict each must reach."""
    table = Table("drill", "verdict it must reach", "spawn only", show_lines=True)
    for d in all_drills():
        table.add_row(d.name, d.summary, "yes" if d.spawn_only else "")
    console.print(table)


@app.command("run")
def run(
    drills: Annotated[list[str], typer.Argument(help="Drill names, or 'all'.")],
    quick: Annotated[bool, typer.Option("--quick", help="The CI size: small loads on a tiny random model.")] = False,
    model: Annotated[str | None, typer.Option(help="Model of spawned deployments (default: tiny with --quick, "
                                                     "else smollm2).")] = None,
    url: Annotated[str | None, typer.Option(help="Drill a running gateway on this host instead of spawning one "
                                                 "(loopback only).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="KVGATE_API_KEY", help="With --url and no admin token: "
                                                "the key to load with (ledger and slot checks are skipped).")] = None,
    admin_token: Annotated[str | None, typer.Option(envvar="KVGATE_ADMIN_TOKEN", help="With --url: provisions a "
                                                    "drill tenant and reads its ledger.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Write the results as JSON here.")] = None,
    keep: Annotated[bool, typer.Option(help="Keep spawned deployments' directories (logs, store).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the drills' random choices.")] = 0,
) -> None:
    """Run drills; the exit status is 1 when any verdict failed."""
    known = by_name()
    names = list(known) if drills == ["all"] else drills
    unknown = [n for n in names if n not in known]
    if unknown:
        raise typer.BadParameter(f"unknown drill(s) {', '.join(unknown)}; see `kvgate chaos list`")
    try:
        options = RunOptions(quick=quick, model=model, url=url, api_key=api_key, admin_token=admin_token,
                             keep=keep, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    started = time.time()
    results = trio.run(run_drills, [known[n] for n in names], options, render_one)
    render_summary(results)
    if json_out is not None:
        report = {"machine": machine(), "size": "quick" if quick else "full", "started_at": started,
                  "model": options.model or ("tiny" if quick else "smollm2"), "url": url,
                  "passed": all(r.passed for r in results), "drills": [r.to_json() for r in results]}
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    raise typer.Exit(0 if all(r.passed for r in results) else 1)


def render_one(r: DrillResult) -> None:
    """One drill's verdict: its checks as a table, then its load, request accounting and measurements."""
    verdict = _VERDICT_STYLE[r.verdict]
    table = Table(title=f"{r.drill} ({r.size}, {r.seconds:.0f}s): {verdict}", title_justify="left",
                  show_header=True, expand=False)
    table.add_column("check")
    table.add_column("", width=4)
    table.add_column("detail", overflow="fold")
    for c in r.checks:
        style = {"pass": "green", "FAIL": "red", "skip": "yellow"}[c.status]
        table.add_row(c.name, f"[{style}]{c.status}[/]", c.detail)
    if r.error:
        table.add_row("drill ran to the end", "[red]FAIL[/]", r.error)
    if r.not_run:
        table.add_row("not run here", "[yellow]skip[/]", r.not_run)
    console.print(table)
    if r.load:
        console.print(f"  load: {r.load}")
    if r.outcomes:
        console.print("  requests: " + ", ".join(f"{k} {v}" for k, v in r.outcomes.items()))
    if r.measurements:
        console.print("  measured: " + ", ".join(f"{k}={v}" for k, v in r.measurements.items()))
    if r.log_tail and not r.passed:
        console.print("  gateway log (tail):", style="dim")
        console.print(r.log_tail[-1500:], style="dim", markup=False, highlight=False)


def render_summary(results: list[DrillResult]) -> None:
    summary = Table("drill", "verdict", "seconds", title="chaos drills", title_justify="left")
    for r in results:
        summary.add_row(r.drill, _VERDICT_STYLE[r.verdict], f"{r.seconds:.0f}")
    console.print(summary)


def main(argv: list[str] | None = None) -> int:
    """Entry for ``kvgate chaos ...`` (console/kvgate.py hands over the rest of the command line); exits the process
    with the drills' status, as Typer's standalone mode does."""
    app(args=sys.argv[1:] if argv is None else argv, prog_name="kvgate chaos")
    return 0
