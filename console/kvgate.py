"""The ``kvgate`` command: a dispatcher. ``serve`` hands its arguments to the gateway's own command line
(``gateway/cli.py``, whose flags are the gateway's configuration and the engine flag table of ``common/``);
``worker`` and ``generate`` are engine-side: this process becomes ``python -m workers.process.cli`` (exec, so
signals and the exit status are the engine's own) and never imports the engine; ``keys`` makes CURVE key pairs
(``console/keys_cli.py``); ``chaos`` runs the drills (``chaos/cli.py``, loaded only when asked for).

Those four hand their arguments on untouched (``-h`` and ``--`` included), so each command's own parser answers
exactly as it did when ``kvgate`` was ``gateway.cli``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import typer

from console.keys_cli import keys_app

app = typer.Typer(help="multi-tenant LLM serving", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(keys_app, name="keys", short_help="CURVE key pairs for the gateway and remote workers (kvgate keys -h)")

# The command's parser owns every argument, its help flag included.
_HANDED_ON: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _rest(ctx: typer.Context) -> list[str]:
    """The arguments after the command name, as typed. ``main`` keeps the command line in the root context: click
    drops a ``--`` from ``ctx.args``, and the command's own parser must see it."""
    argv = ctx.find_root().obj
    return list(argv[1:]) if isinstance(argv, list) else list(ctx.args)


def _exec_engine(command: str, args: list[str]) -> NoReturn:
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "workers.process.cli", command, *args])


@app.command("serve", context_settings=_HANDED_ON, add_help_option=False,
             help="serve the OpenAI API (gateway + local workers)")
def serve(ctx: typer.Context) -> None:
    from gateway.cli import main as serve_main  # no torch in this process

    raise typer.Exit(serve_main(["serve", *_rest(ctx)]))


@app.command("worker", context_settings=_HANDED_ON, add_help_option=False,
             help="run one engine replica connected to a gateway (kvgate worker -h)")
def worker(ctx: typer.Context) -> None:
    _exec_engine("worker", _rest(ctx))


@app.command("generate", context_settings=_HANDED_ON, add_help_option=False,
             help="stream a completion in-process, no server (kvgate generate -h)")
def generate(ctx: typer.Context) -> None:
    _exec_engine("generate", _rest(ctx))


@app.command("chaos", context_settings=_HANDED_ON, add_help_option=False,
             help="drills that break a deployment on purpose (kvgate chaos --help)")
def chaos(ctx: typer.Context) -> None:
    from chaos.cli import main as chaos_main  # the drills and their clients load only for this command

    raise typer.Exit(chaos_main(_rest(ctx)))


def main(argv: list[str] | None = None) -> int:
    """The ``kvgate`` entry point. Exits the process with the command's status, as Typer's standalone mode does."""
    args = sys.argv[1:] if argv is None else list(argv)
    app(args=args, prog_name="kvgate", obj=args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
