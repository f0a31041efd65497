"""``kvgatectl adapters``: register, list and unregister LoRA adapters.

``add`` runs through a gateway (``--url`` and ``--admin-token``): only the gateway knows its ``--lora-dir`` and its
base model, which an adapter is checked against before it is registered. ``list`` and ``rm`` work in both modes
(the store is the registry; gateways read it within a second).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from tenancy.admin_ops import Json

# console.kvgatectl's _run(ctx, json_flag, op, show): handed in, since this module must not import the one that
# registers it (run as ``python -m console.kvgatectl`` that would load a second copy with its own Settings)
Run = Callable[[typer.Context, bool, Callable[[Any], Json], Callable[[Console, Json], None]], Json]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (the admin API's shapes).")]
NameArg = Annotated[str, typer.Argument(help="The adapter's name: what a request's `model` gives.")]


def _render_adapters(console: Console, result: Json) -> None:
    from console.render import _row, _table, fmt_time

    table = _table(None, "name", "path", "tenant", "created")
    for a in result["data"]:
        _row(table, a["name"], a["path"], a["tenant"] or "(global)", fmt_time(a["created_at"], short=True))
    console.print(table)


def _render_added(console: Console, result: Json) -> None:
    owner = result["tenant"] or "every tenant (global)"
    console.print(f"registered LoRA adapter {escape(result['name'])} (rank {result['rank']}, "
                  f"{escape(', '.join(result['target_modules']))}) from {escape(result['path'])} for {escape(owner)}")


def _render_removed(console: Console, result: Json) -> None:
    console.print(f"unregistered LoRA adapter {escape(result['name'])}")


def build(run: Run) -> typer.Typer:
    """The ``adapters`` command group over kvgatectl's backend runner."""
    app = typer.Typer(help="Register, list and remove LoRA adapters (add needs --url).", no_args_is_help=True)

    @app.command("add")
    def adapters_add(ctx: typer.Context, name: NameArg,
                     path: Annotated[str, typer.Argument(help="Its directory, relative to the gateway's --lora-dir "
                                                              "(or absolute, inside it).")],
                     tenant: Annotated[str | None, typer.Option(help="The owning tenant (name or id); default: "
                                                                     "global, every tenant may use it.")] = None,
                     json_out: JsonOpt = False) -> None:
        """Check an adapter against the gateway's base model and register it."""
        if not getattr(ctx.find_root().obj, "url", None):
            raise typer.BadParameter("adding an adapter needs the gateway that checks it against its base model: "
                                     "give --url and --admin-token (or KVGATE_URL and KVGATE_ADMIN_TOKEN)",
                                     param_hint="--url")
        run(ctx, json_out, lambda b: b.load_adapter(name, path, tenant), _render_added)

    @app.command("list")
    def adapters_list(ctx: typer.Context,
                      tenant: Annotated[str | None, typer.Option(help="Only the adapters this tenant owns.")] = None,
                      json_out: JsonOpt = False) -> None:
        """List registered adapters."""
        run(ctx, json_out, lambda b: b.list_adapters(tenant), _render_adapters)

    @app.command("rm")
    def adapters_rm(ctx: typer.Context, name: NameArg, json_out: JsonOpt = False) -> None:
        """Unregister an adapter: requests naming it get 404 from then on (within a second on every gateway)."""
        run(ctx, json_out, lambda b: b.unload_adapter(name), _render_removed)

    return app
