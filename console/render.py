"""kvgatectl's human output: Rich tables over the admin JSON shapes (tenancy.admin_ops), and CSV for usage."""

from __future__ import annotations

import csv
import io
import os
from datetime import datetime, timezone
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tenancy.admin_ops import Json
from tenancy.admin_values import QUOTA_FIELDS

USAGE_COLUMNS = ("group", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
_NONE = "-"
_IDS = ("id", "tenant")
_ID_CHARS = 20  # ten_/key_ + 16 hex digits
PIPE_WIDTH = 160  # when stdout is not a terminal, Rich would assume 80 columns and squeeze the tables


def fmt_time(t: float | None, *, short: bool = False) -> str:
    if t is None:
        return _NONE
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%MZ" if short else "%Y-%m-%d %H:%M:%SZ")


def fmt(value: Any) -> str:
    if value is None:
        return _NONE
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def make_console() -> Console:
    # No emoji codes: values such as uniform:100:400 or a tenant named ':fire:' are printed as written.
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def _table(title: str | None, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for column in columns:
        whole = column in _IDS  # ids stay whole and on one line: people copy them
        table.add_column(column, overflow="fold", no_wrap=whole, min_width=_ID_CHARS if whole else None)
    return table


def _row(table: Table, *cells: Any) -> None:
    table.add_row(*(escape(fmt(c)) for c in cells))


def _fields(console: Console, title: str, pairs: list[tuple[str, Any]]) -> None:
    table = _table(title, "field", "value")
    for name, value in pairs:
        _row(table, name, value)
    console.print(table)


def fmt_on_off(flag: bool) -> str:
    return "on" if flag else "off"


def tenant_pairs(t: Json) -> list[tuple[str, Any]]:
    return [("id", t["id"]), ("name", t["name"]), ("status", t["status"]), ("tier", t.get("tier", "standard")),
            ("weight", t["weight"]), ("log text", fmt_on_off(t["log_text"])), ("created", fmt_time(t["created_at"]))]


def render_tenant(console: Console, t: Json) -> None:
    _fields(console, f"tenant {t['name']}", tenant_pairs(t))


def render_tenants(console: Console, result: Json) -> None:
    table = _table(None, "id", "name", "status", "tier", "weight", "log text", "created")
    for t in result["data"]:
        _row(table, t["id"], t["name"], t["status"], t.get("tier", "standard"), t["weight"],
             fmt_on_off(t["log_text"]), fmt_time(t["created_at"]))
    console.print(table if result["data"] else "no tenants")


def render_tenant_detail(console: Console, t: Json) -> None:
    render_tenant(console, t)
    render_keys(console, {"data": t["keys"]})
    _fields(console, "quota (tenant row)", [(f, t["quota"][f]) for f in QUOTA_FIELDS])


def render_tiers(console: Console, result: Json) -> None:
    table = _table(None, "tier", "priority", "capacity share", "what it means")
    for t in result["data"]:
        _row(table, t["name"], t["priority"], t["capacity_share"], t["description"])
    console.print(table)
    console.print("priority: where a request starts in the workers' queues (lower runs sooner; a request's own "
                  "priority counts from it). capacity share: of each worker's admission bounds, all tiers' "
                  "requests counted.")


def render_deleted(console: Console, result: Json) -> None:
    console.print(f"deleted tenant {escape(result['name'])} ({result['id']}); its usage stays in the ledger")


def render_keys(console: Console, result: Json) -> None:
    keys = result["data"]
    owners = {k["tenant_id"] for k in keys}
    one_owner = len(owners) == 1
    columns = ("id", "label", "prefix", "status", "created", "expires")
    table = _table(f"keys of {next(iter(owners))}" if one_owner else None,
                   *columns[:1], *(() if one_owner else ("tenant",)), *columns[1:])
    for k in keys:
        owner = () if one_owner else (k["tenant_id"],)
        _row(table, k["id"], *owner, k["label"], k["key_prefix"], k["status"],
             fmt_time(k["created_at"], short=True), fmt_time(k["expires_at"], short=True))
    console.print(table if keys else "no keys")


def render_new_key(console: Console, k: Json) -> None:
    _fields(console, f"key {k['id']}", [("tenant_id", k["tenant_id"]), ("label", k["label"]),
                                          ("expires", fmt_time(k["expires_at"]))])
    console.print(f"API key: [bold]{escape(k['key'])}[/bold]")
    console.print(f"[yellow]{escape(NEW_KEY_WARNING)}[/yellow]")


NEW_KEY_WARNING = "Save this key now: it cannot be shown again (only its hash is stored)."


def render_revoked(console: Console, k: Json) -> None:
    verb = "revoked" if k["was_active"] else "was already revoked:"
    console.print(f"{verb} key {k['id']} ({escape(k['key_prefix'])}...) of tenant {k['tenant_id']}")


def render_quota(console: Console, q: Json) -> None:
    scope = f"key {q['key_id']}" if q["scope"] == "key" else "tenant"
    table = _table(f"quota of {q['tenant']} ({scope})", "field", f"{q['scope']} row", "effective")
    for name in QUOTA_FIELDS:
        _row(table, name, q["row"][name], q["effective"][name])
    console.print(table)
    console.print("- means unlimited" + (" (in the key row: inherit the tenant's value)" if q["scope"] == "key"
                                         else ""))


def render_usage(console: Console, u: Json) -> None:
    since = f" since {fmt_time(u['since'])}" if u["since"] is not None else ""
    title = f"usage{' by ' + u['by'] if u['by'] else ''}{since}"
    table = _table(title, *(u["by"] or "total", *USAGE_COLUMNS[1:]))
    for g in u["data"]:
        _row(table, *(g[c] if c != "group" else (g[c] or _NONE) for c in USAGE_COLUMNS))
    console.print(table if u["data"] else "no usage")


def usage_csv(u: Json) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(USAGE_COLUMNS)
    for g in u["data"]:
        writer.writerow([g[c] for c in USAGE_COLUMNS])
    return out.getvalue()
