"""kvgatectl: manage kvgate tenants, API keys, quotas and usage (and, remote mode, a gateway's workers).

Local mode (``--db PATH`` or ``--db postgresql://...``, env KVGATE_DB) opens the store directly, with the
deployment's server secret (KVGATE_SECRET, or ``<db>.secret`` beside an SQLite file); remote mode (``--url URL --admin-token T``, env KVGATE_URL and
KVGATE_ADMIN_TOKEN) calls a running gateway's ``/admin`` API. Both are an ``AdminBackend``, so each command is
written once and ``--json`` prints the same shapes either way. Exit codes: 0 done, 1 the operation failed
(unknown tenant or key, an error from the gateway, no gateway at the URL), 2 bad usage.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console

from console import render
from tenancy.admin_ops import AdminBackend, AdminOpError, Json, LocalAdmin
from tenancy.admin_values import QUOTA_FIELDS
from tenancy.db_backend import redact
from tenancy.store import open_store
from tenancy.tiers import DEFAULT_TIER, TierName

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON (the admin API's shapes).")]
TenantArg = Annotated[str, typer.Argument(help="Tenant name or id.")]
Count = Annotated[int | None, typer.Option(min=1, max=2**53)]
_CLEAR_ALIASES = {"budget": "token_budget", "models": "allowed_models"}

app = typer.Typer(help="Manage kvgate tenants, API keys, quotas and usage.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
tenant_app = typer.Typer(help="Create, inspect, suspend and delete tenants.", no_args_is_help=True)
key_app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
quota_app = typer.Typer(help="Set and show quotas (per tenant or per key).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(quota_app, name="quota")


@dataclass(frozen=True)
class Settings:
    db: str  # an SQLite path or a PostgreSQL URL (a Path would fold the URL's //)
    url: str | None
    admin_token: str | None
    json: bool


@app.callback()
def global_options(
    ctx: typer.Context,
    db: Annotated[str, typer.Option(envvar="KVGATE_DB", help="Tenancy store (local mode): an SQLite file or a "
                                    "postgresql:// URL.")] = "kvgate.db",
    url: Annotated[str | None, typer.Option(envvar="KVGATE_URL", help="Gateway URL (remote mode).")] = None,
    admin_token: Annotated[str | None, typer.Option(envvar="KVGATE_ADMIN_TOKEN", show_envvar=True,
                                                    help="The gateway's admin token (remote mode).")] = None,
    json_out: JsonFlag = False,
) -> None:
    ctx.obj = Settings(db, url, admin_token, json_out)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextmanager
def _backend(settings: Settings) -> Iterator[AdminBackend]:
    if settings.url:
        if not settings.admin_token:
            raise typer.BadParameter("--url needs --admin-token (or KVGATE_ADMIN_TOKEN)", param_hint="--admin-token")
        from console.admin_client import RemoteAdmin

        with RemoteAdmin(settings.url, settings.admin_token) as remote:
            yield remote
        return
    try:
        store, _ = open_store(settings.db)
    except (sqlite3.Error, OSError, ValueError, RuntimeError) as e:
        _fail(f"cannot open the store {redact(settings.db)}: {e}")
    try:
        yield LocalAdmin(store)
    finally:
        store.close()


def _run(ctx: typer.Context, json_flag: bool, op: Callable[[AdminBackend], Json],
         show: Callable[[Console, Json], None]) -> Json:
    """Runs one operation on the chosen backend and prints its result (JSON or `show`); exits 1 on failure."""
    settings: Settings = ctx.find_object(Settings) or Settings("kvgate.db", None, None, False)
    try:
        with _backend(settings) as backend:
            result = op(backend)
    except AdminOpError as e:
        _fail(e.message)
    if settings.json or json_flag:
        typer.echo(json.dumps(result, indent=2))
    else:
        show(render.make_console(), result)
    return result


def _wants_json(ctx: typer.Context, json_flag: bool) -> bool:
    settings = ctx.find_object(Settings)
    return json_flag or (settings is not None and settings.json)


# --- tenants -----------------------------------------------------------------------------------------------

TierArg = Annotated[TierName, typer.Argument(help="interactive, standard or batch (see `kvgatectl tiers`).")]


@tenant_app.command("create")
def tenant_create(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Tenant name.")],
                  weight: Annotated[float, typer.Option(help="Fair-share scheduling weight (> 0).")] = 1.0,
                  tier: Annotated[TierName, typer.Option(help="Its plan: interactive, standard or batch.")
                                  ] = DEFAULT_TIER,
                  json_out: JsonFlag = False) -> None:
    """Create a tenant."""
    _run(ctx, json_out, lambda b: b.create_tenant(name, weight, tier), render.render_tenant)


@tenant_app.command("list")
def tenant_list(ctx: typer.Context, json_out: JsonFlag = False) -> None:
    """List tenants."""
    _run(ctx, json_out, lambda b: b.list_tenants(), render.render_tenants)


@tenant_app.command("show")
def tenant_show(ctx: typer.Context, ref: TenantArg, json_out: JsonFlag = False) -> None:
    """Show a tenant with its keys and its quota."""
    _run(ctx, json_out, lambda b: b.show_tenant(ref), render.render_tenant_detail)


@tenant_app.command("suspend")
def tenant_suspend(ctx: typer.Context, ref: TenantArg, json_out: JsonFlag = False) -> None:
    """Suspend a tenant: its keys are refused (403) until it is resumed."""
    _run(ctx, json_out, lambda b: b.suspend_tenant(ref), render.render_tenant)


@tenant_app.command("resume")
def tenant_resume(ctx: typer.Context, ref: TenantArg, json_out: JsonFlag = False) -> None:
    """Resume a suspended tenant."""
    _run(ctx, json_out, lambda b: b.resume_tenant(ref), render.render_tenant)


@tenant_app.command("set-weight")
def tenant_set_weight(ctx: typer.Context, ref: TenantArg,
                      weight: Annotated[float, typer.Argument(help="New weight (> 0).")],
                      json_out: JsonFlag = False) -> None:
    """Change a tenant's fair-share scheduling weight."""
    _run(ctx, json_out, lambda b: b.update_tenant(ref, weight), render.render_tenant)


@tenant_app.command("set-tier")
def tenant_set_tier(ctx: typer.Context, ref: TenantArg, tier: TierArg, json_out: JsonFlag = False) -> None:
    """Put a tenant on a tier: its requests' engine priority and admission share (applies within a second)."""
    _run(ctx, json_out, lambda b: b.set_tier(ref, tier), render.render_tenant)


@tenant_app.command("set-log-text")
def tenant_set_log_text(ctx: typer.Context, ref: TenantArg,
                        state: Annotated[Literal["on", "off"], typer.Argument(help="on or off.")],
                        json_out: JsonFlag = False) -> None:
    """Log (on) or stop logging (off) a tenant's prompt and completion text in request_finished lines."""
    _run(ctx, json_out, lambda b: b.set_log_text(ref, state == "on"), render.render_tenant)


@tenant_app.command("delete")
def tenant_delete(ctx: typer.Context, ref: TenantArg,
                  yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
                  json_out: JsonFlag = False) -> None:
    """Delete a tenant with its keys and quotas (its usage stays in the ledger)."""
    if not yes:
        typer.confirm(f"Delete tenant {ref!r} with its keys and quotas?", abort=True, err=True)
    _run(ctx, json_out, lambda b: b.delete_tenant(ref), render.render_deleted)


# --- keys --------------------------------------------------------------------------------------------------

@key_app.command("create")
def key_create(ctx: typer.Context, tenant: TenantArg,
               label: Annotated[str, typer.Option(help="A note to recognise the key by.")] = "",
               expires_in_days: Annotated[float | None, typer.Option(help="Expire after this many days.")] = None,
               json_out: JsonFlag = False) -> None:
    """Create an API key; its plaintext is shown this once."""
    _run(ctx, json_out, lambda b: b.create_key(tenant, label, None, expires_in_days), render.render_new_key)
    if _wants_json(ctx, json_out):
        typer.echo(render.NEW_KEY_WARNING, err=True)


@key_app.command("list")
def key_list(ctx: typer.Context,
             tenant: Annotated[str | None, typer.Argument(help="Only this tenant's keys.")] = None,
             json_out: JsonFlag = False) -> None:
    """List API keys (never their plaintext)."""
    _run(ctx, json_out, lambda b: b.list_keys(tenant), render.render_keys)


@key_app.command("revoke")
def key_revoke(ctx: typer.Context, key_id: Annotated[str, typer.Argument(help="The key's id (key_...).")],
               json_out: JsonFlag = False) -> None:
    """Revoke an API key at once."""
    _run(ctx, json_out, lambda b: b.revoke_key(key_id), render.render_revoked)


# --- quotas ------------------------------------------------------------------------------------------------

def _clear_fields(names: list[str]) -> list[str]:
    fields = []
    for raw in names:
        name = raw.strip().replace("-", "_")
        name = _CLEAR_ALIASES.get(name, name)
        if name == "all":
            return list(QUOTA_FIELDS)
        if name not in QUOTA_FIELDS:
            raise typer.BadParameter(f"unknown quota field {raw!r}; known: {', '.join(QUOTA_FIELDS)} or all",
                                     param_hint="--clear")
        fields.append(name)
    return fields


def _quota_patch(values: dict[str, Any], clear: list[str]) -> dict[str, Any]:
    patch = {name: value for name, value in values.items() if value is not None}
    for name in _clear_fields(clear):
        if name in patch:
            raise typer.BadParameter(f"{name} is both set and cleared", param_hint="--clear")
        patch[name] = None
    if not patch:
        raise typer.BadParameter("give at least one limit to set or a field to --clear")
    return patch


@quota_app.command("set")
def quota_set(ctx: typer.Context, tenant: TenantArg,
              key: Annotated[str | None, typer.Option("--key", help="Set the key's own row (key_...).")] = None,
              rpm: Count = None, tpm: Count = None, max_concurrent: Count = None,
              budget: Annotated[int | None, typer.Option(min=1, max=2**53, help="Token budget per period.")] = None,
              budget_period: Annotated[Literal["day", "month"] | None, typer.Option()] = None,
              max_tokens_per_request: Count = None, max_prompt_tokens: Count = None,
              models: Annotated[str | None, typer.Option(help="Allowed models, comma-separated.")] = None,
              clear: Annotated[list[str] | None, typer.Option(help="Clear a field (unlimited/inherit); repeat; "
                                                                   "'all' clears every field.")] = None,
              json_out: JsonFlag = False) -> None:
    """Merge limits into a quota row; fields not given keep their value."""
    allowed = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
    patch = _quota_patch({"rpm": rpm, "tpm": tpm, "max_concurrent": max_concurrent, "token_budget": budget,
                          "budget_period": budget_period, "max_tokens_per_request": max_tokens_per_request,
                          "max_prompt_tokens": max_prompt_tokens, "allowed_models": allowed}, clear or [])
    _run(ctx, json_out, lambda b: b.update_quota(tenant, patch, key), render.render_quota)


@quota_app.command("show")
def quota_show(ctx: typer.Context, tenant: TenantArg,
               key: Annotated[str | None, typer.Option("--key", help="Show the key's row (key_...).")] = None,
               json_out: JsonFlag = False) -> None:
    """Show a quota row and the effective quota."""
    _run(ctx, json_out, lambda b: b.get_quota(tenant, key), render.render_quota)


# --- tiers -------------------------------------------------------------------------------------------------

@app.command("tiers")
def tiers(ctx: typer.Context, json_out: JsonFlag = False) -> None:
    """The tiers a tenant can be on: engine priority (lower runs sooner) and share of each worker's admission."""
    _run(ctx, json_out, lambda b: b.tiers(), render.render_tiers)


# --- usage -------------------------------------------------------------------------------------------------

@app.command("usage")
def usage(ctx: typer.Context,
          tenant: Annotated[str | None, typer.Argument(help="Only this tenant (default: all).")] = None,
          since: Annotated[str | None, typer.Option(help="Unix seconds, ISO date/time, or relative: 7d, 24h.")] = None,
          by: Annotated[Literal["day", "model", "key", "adapter"] | None, typer.Option(help="Group by.")] = None,
          fmt: Annotated[Literal["table", "json", "csv"], typer.Option("--format")] = "table",
          json_out: JsonFlag = False) -> None:
    """Token usage from the ledger: totals, or grouped by day (UTC), model, key or LoRA adapter ('' = base)."""
    if fmt == "csv" and not _wants_json(ctx, json_out):
        _run(ctx, False, lambda b: b.usage(tenant, since, by), lambda _c, u: typer.echo(render.usage_csv(u), nl=False))
        return
    _run(ctx, json_out or fmt == "json", lambda b: b.usage(tenant, since, by), render.render_usage)


# --- top ---------------------------------------------------------------------------------------------------

@app.command("top")
def top(ctx: typer.Context,
        url: Annotated[str | None, typer.Option(help="Gateway URL (default: the global --url or KVGATE_URL).")] = None,
        interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
        once: Annotated[bool, typer.Option("--once", help="Print one frame (two samples apart) and exit.")] = False,
        iterations: Annotated[int | None, typer.Option(min=1, help="Stop after this many refreshes.")] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one view as JSON (implies --once).")] = False,
        ) -> None:
    """Live view of a gateway's workers and tenants from its /metrics (no admin token needed)."""
    settings = ctx.find_object(Settings)
    target = url or (settings.url if settings else None)
    if not target:
        raise typer.BadParameter("give the gateway's --url (or set KVGATE_URL)", param_hint="--url")
    from console.top import TopError, run_top  # httpx and prometheus_client load only for this command

    try:
        run_top(target, interval, once, iterations, _wants_json(ctx, json_out))
    except TopError as e:
        _fail(str(e))


# --- plan (console/plan_cli.py) --------------------------------------------------------------------------
from console.plan_cli import plan_command  # noqa: E402  (registered here so `kvgatectl plan` exists)

app.command("plan")(plan_command)

# --- worker (console/worker_cli.py): drain and rolling restart over the gateway's /admin/workers ------------
from console.worker_cli import worker_app  # noqa: E402

app.add_typer(worker_app, name="worker")

# --- adapters (console/adapter_cli.py): LoRA adapters, registered through a gateway --------------------------
from console import adapter_cli  # noqa: E402

app.add_typer(adapter_cli.build(_run), name="adapters")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
