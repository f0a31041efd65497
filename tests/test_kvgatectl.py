"""kvgatectl (console/kvgatectl.py) through Typer's CliRunner: local mode on a temp store, and remote mode against the
admin API served by Hypercorn (trio worker) on 127.0.0.1 in a background thread, with the same JSON shapes."""

from __future__ import annotations

import csv
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hypercorn.trio
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from typer.testing import CliRunner, Result

from console.kvgatectl import app
from tenancy.models import UsageRow
from tenancy.store import TenancyStore, open_store
from tests.test_gateway_admin import TOKEN, make_admin_app
from tests.test_gateway_support import free_port

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVGATE_DB", "KVGATE_URL", "KVGATE_ADMIN_TOKEN", "KVGATE_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # Rich tables: no folding in the assertions' way


@dataclass
class Cli:
    base: list[str]

    def __call__(self, *args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(app, [*self.base, *args], input=input)

    def ok(self, *args: str) -> Result:
        result = self(*args)
        assert result.exit_code == 0, result.output
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.ok("--json", *args).stdout)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "kvgate.db"


@pytest.fixture
def local(db: Path) -> Cli:
    return Cli(["--db", str(db)])


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[tuple[Cli, TenancyStore]]:
    """The admin API on a real socket: Hypercorn's trio worker in a thread, stopped through its trio token."""
    store = TenancyStore(tmp_path / "remote.db", b"remote-pepper")
    port = free_port()
    config = HyperConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    started = threading.Event()
    handles: dict[str, Any] = {}

    async def serve() -> None:
        handles["token"], handles["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(hypercorn.trio.serve, make_admin_app(store, TOKEN), config,
                                        shutdown_trigger=handles["stop"].wait))
            started.set()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    assert started.wait(10), "admin server did not start"
    yield Cli(["--url", f"http://127.0.0.1:{port}", "--admin-token", TOKEN]), store
    trio.from_thread.run_sync(handles["stop"].set, trio_token=handles["token"])
    thread.join(10)
    store.close()


def lifecycle(cli: Cli) -> dict[str, Any]:
    """The whole tenant/key/quota story via --json; returns every answer by step name."""
    out: dict[str, Any] = {}
    out["create"] = cli.json("tenant", "create", "acme", "--weight", "2")
    out["list"] = cli.json("tenant", "list")
    out["weight"] = cli.json("tenant", "set-weight", "acme", "3")
    out["log_text_on"] = cli.json("tenant", "set-log-text", "acme", "on")
    out["log_text_show"] = cli.json("tenant", "show", "acme")
    out["log_text_off"] = cli.json("tenant", "set-log-text", out["create"]["id"], "off")
    out["suspend"] = cli.json("tenant", "suspend", "acme")
    out["resume"] = cli.json("tenant", "resume", out["create"]["id"])
    out["key"] = cli.json("key", "create", "acme", "--label", "ci", "--expires-in-days", "30")
    out["keys"] = cli.json("key", "list", "acme")
    out["all_keys"] = cli.json("key", "list")
    out["quota"] = cli.json("quota", "set", "acme", "--rpm", "10", "--models", "a,b")
    out["quota2"] = cli.json("quota", "set", "acme", "--tpm", "500", "--budget", "100", "--budget-period", "day")
    out["key_quota"] = cli.json("quota", "set", "acme", "--key", out["key"]["id"], "--rpm", "2")
    out["quota_cleared"] = cli.json("quota", "set", "acme", "--clear", "rpm", "--clear", "models")
    out["key_quota_show"] = cli.json("quota", "show", "acme", "--key", out["key"]["id"])
    out["show"] = cli.json("tenant", "show", "acme")
    out["usage"] = cli.json("usage", "acme", "--by", "model", "--since", "7d")
    out["revoke"] = cli.json("key", "revoke", out["key"]["id"])
    out["delete"] = cli.json("tenant", "delete", "acme", "--yes")
    return out


def check_lifecycle(out: dict[str, Any]) -> None:
    assert out["list"]["data"] == [out["create"]]
    assert out["weight"]["weight"] == 3.0
    assert out["create"]["log_text"] is False and out["list"]["data"][0]["log_text"] is False
    assert out["log_text_on"] == {**out["weight"], "log_text": True} and out["log_text_show"]["log_text"] is True
    assert out["log_text_off"] == out["weight"] and out["show"]["log_text"] is False
    assert out["suspend"]["status"] == "suspended" and out["resume"]["status"] == "active"
    key = out["key"]
    assert key["key"].startswith("kvg-") and key["status"] == "active"
    assert out["keys"] == out["all_keys"] and "key" not in out["keys"]["data"][0]
    assert out["quota"]["row"]["rpm"] == 10 and out["quota"]["row"]["allowed_models"] == ["a", "b"]
    row = out["quota2"]["row"]
    assert (row["rpm"], row["tpm"], row["token_budget"], row["budget_period"]) == (10, 500, 100, "day")
    assert out["key_quota"]["effective"]["rpm"] == 2 and out["key_quota"]["effective"]["tpm"] == 500
    cleared = out["quota_cleared"]["row"]
    assert cleared["rpm"] is None and cleared["allowed_models"] is None and cleared["tpm"] == 500
    assert out["key_quota_show"]["row"]["rpm"] == 2 and out["key_quota_show"]["effective"]["tpm"] == 500
    assert out["show"]["quota"] == cleared and [k["id"] for k in out["show"]["keys"]] == [key["id"]]
    assert out["usage"]["data"] == [] and out["usage"]["by"] == "model"
    assert out["revoke"]["status"] == "revoked" and out["revoke"]["was_active"] is True
    assert out["delete"]["deleted"] is True


def shape(value: Any) -> Any:
    """Keys and value types, not values: ids and times differ between two stores."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def test_local_lifecycle_and_key_auth(local: Cli, db: Path) -> None:
    out = lifecycle(local)
    check_lifecycle(out)
    # The key the CLI printed authenticated until it was revoked; the server secret lives beside the DB.
    assert db.with_name("kvgate.db.secret").exists()
    store, _ = open_store(db)
    with store:
        assert store.authenticate(out["key"]["key"]) is None  # revoked (and the tenant is gone)


def test_cli_key_authenticates_then_revoke_stops_it(local: Cli, db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_SECRET", "s" * 32)
    local.ok("tenant", "create", "acme")
    human = local.ok("key", "create", "acme", "--label", "laptop").stdout
    assert "cannot be shown again" in human
    plaintext = next(w for w in human.split() if w.startswith("kvg-"))
    store, _ = open_store(db)
    with store:
        auth = store.authenticate(plaintext)
        assert auth is not None and auth.tenant_name == "acme"
        listed = local.ok("key", "list").stdout
        assert auth.key_id in listed and plaintext not in listed
        local.ok("key", "revoke", auth.key_id)
        assert store.authenticate(plaintext) is None
    assert "already revoked" in local.ok("key", "revoke", auth.key_id).stdout


def test_human_tables_and_per_command_json(local: Cli) -> None:
    local.ok("tenant", "create", "acme")
    local.ok("tenant", "create", "bravo", "--weight", "0.5")
    table = local.ok("tenant", "list").stdout
    assert "acme" in table and "bravo" in table and "0.5" in table
    assert [t["name"] for t in json.loads(local.ok("tenant", "list", "--json").stdout)["data"]] == ["acme", "bravo"]
    assert "rpm" in local.ok("quota", "show", "acme").stdout
    assert "acme" in local.ok("tenant", "show", "acme").stdout
    assert _field(local.ok("tenant", "show", "acme").stdout, "log text") == "off"
    assert _field(local.ok("tenant", "set-log-text", "acme", "on").stdout, "log text") == "on"
    assert _field(local.ok("tenant", "show", "acme").stdout, "log text") == "on"


def _field(table: str, name: str) -> str:
    """The value beside `name` in a rendered field/value table."""
    line = next(line for line in table.splitlines() if line.strip().startswith(name + " "))
    return line.strip()[len(name):].strip()


def test_exit_codes(local: Cli) -> None:
    local.ok("tenant", "create", "acme")
    failing: list[tuple[str, ...]] = [
        ("tenant", "show", "nope"), ("key", "revoke", "key_nope"), ("tenant", "create", "acme"),
        ("tenant", "create", "bad name"), ("quota", "set", "acme", "--key", "key_nope", "--rpm", "1"),
        ("quota", "set", "acme", "--budget", "5"), ("usage", "--since", "yesterday"),
        ("tenant", "set-log-text", "nope", "on")]
    for args in failing:
        result = local(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    misused: list[tuple[str, ...]] = [
        ("quota", "set", "acme", "--rpm", "-1"), ("quota", "set", "acme"), ("tenant", "frobnicate"),
        ("quota", "set", "acme", "--clear", "colour"), ("usage", "--by", "hour"),
        ("quota", "set", "acme", "--rpm", "1", "--clear", "rpm"), ("tenant", "set-log-text", "acme", "yes"),
        ("tenant", "set-log-text", "acme")]
    for args in misused:
        assert local(*args).exit_code == 2, args
    declined = local("tenant", "delete", "acme", input="n\n")
    assert declined.exit_code == 1
    assert local("tenant", "show", "acme").exit_code == 0
    assert local("tenant", "delete", "acme", input="y\n").exit_code == 0


def test_usage_formats(local: Cli, db: Path) -> None:
    local.ok("tenant", "create", "acme")
    store, _ = open_store(db)
    with store:
        tenant_id = store.get_tenant("acme").id
        store.record_usage([UsageRow("r1", tenant_id, None, "m1", 10, 4, 5, "stop", T0, T0 + 1),
                            UsageRow("r2", tenant_id, None, "m2", 7, 0, 3, "stop", T0 + 5, T0 + 6)])
    rows = list(csv.DictReader(io.StringIO(local.ok("usage", "acme", "--by", "model", "--format", "csv").stdout)))
    assert [(r["group"], r["total_tokens"], r["cached_tokens"]) for r in rows] == [("m1", "15", "4"), ("m2", "10", "0")]
    as_json = json.loads(local.ok("usage", "--since", "2023-11-14", "--format", "json").stdout)
    assert as_json["data"][0]["requests"] == 2 and as_json["since"] == T0 - (22 * 3600 + 800)
    assert as_json == local.json("usage", "--since", "2023-11-14")
    assert "m1" in local.ok("usage", "--by", "model").stdout


def test_remote_mode_matches_local_shapes(local: Cli, remote: tuple[Cli, TenancyStore]) -> None:
    cli, store = remote
    remote_out = lifecycle(cli)
    check_lifecycle(remote_out)
    assert shape(remote_out) == shape(lifecycle(local))
    assert cli.json("tenant", "list") == {"object": "list", "data": []}
    assert not store.list_tenants()


def test_remote_errors(remote: tuple[Cli, TenancyStore]) -> None:
    cli, _ = remote
    result = cli("tenant", "show", "nope")
    assert result.exit_code == 1 and result.stderr.strip() == "error: unknown tenant 'nope'"
    wrong = Cli([cli.base[0], cli.base[1], "--admin-token", "wrong"])("tenant", "list")
    assert wrong.exit_code == 1 and "admin token" in wrong.stderr
    refused = Cli(["--url", f"http://127.0.0.1:{free_port()}", "--admin-token", "t"])("tenant", "list")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: cannot reach the gateway")
    assert len(refused.stderr.strip().splitlines()) == 1
    assert Cli([cli.base[0], cli.base[1]])("tenant", "list").exit_code == 2  # --url without a token
