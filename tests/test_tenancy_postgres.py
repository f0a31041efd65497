"""The tenancy store on PostgreSQL: what only a shared database shows (several gateways writing at once, a fresh
database migrated by whoever starts first), what is kept at rest, and kvgatectl against a URL. The backend-neutral
suite (tests/test_tenancy_store.py) runs on PostgreSQL too."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import pytest
from typer.testing import CliRunner

from tenancy import db_postgres, schema
from console.kvgatectl import app
from tenancy.db_backend import is_url, redact
from tenancy.models import Quota, UsageRow
from tenancy.server_secret import ServerSecret
from tenancy.store import TenancyStore, open_store

PEPPER = b"test-pepper"
SECRET = "s" * 32
T = TypeVar("T")


def _row(rid: str, tenant_id: str) -> UsageRow:
    return UsageRow(rid, tenant_id, None, "m", 10, 0, 5, "stop", 1_700_000_000.0, 1_700_000_001.0)


def _at_once(n: int, work: Callable[[int], T]) -> list[T]:
    """Runs work(0..n-1) in n threads released together; returns the results in index order."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def test_url_selects_postgres_and_passwords_are_redacted() -> None:
    assert is_url("postgresql://u:pw@h:5432/db") and is_url("postgres://h/db")
    assert not is_url("kvgate.db") and not is_url("/var/lib/postgresql://x") and not is_url("sqlite:///x")
    assert redact("postgresql://kvgate:hunter2@db:5432/k") == "postgresql://kvgate:***@db:5432/k"
    assert redact("postgresql://kvgate@db/k") == "postgresql://kvgate@db/k"


def test_fresh_database_is_migrated_once_by_concurrent_gateways(postgres_url: str) -> None:
    stores = _at_once(4, lambda _: TenancyStore(postgres_url, PEPPER))
    try:
        applied = sorted((s.applied_migrations for s in stores), key=len)
        assert applied == [[], [], [], [v for v, _ in schema.MIGRATIONS]]
        assert {s.schema_version for s in stores} == {schema.LATEST_VERSION}
        assert stores[0].dialect == "postgresql"
    finally:
        for s in stores:
            s.close()
    with psycopg.connect(postgres_url) as conn:
        types = dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                                  "WHERE table_name = 'usage'").fetchall())
    assert types["started_at"] == types["ttft_ms"] == "double precision"  # not REAL: float4 rounds Unix times


def test_ledger_counts_each_request_once_across_gateways(postgres_url: str) -> None:
    """Two gateways (stores) retrying overlapping batches at once: every request id lands once, and the 'new rows'
    the writers report add up to exactly the rows there."""
    gateways = [TenancyStore(postgres_url, PEPPER), TenancyStore(postgres_url, PEPPER)]
    try:
        tenant = gateways[0].create_tenant("acme")
        batches = [[_row(f"r{j}", tenant.id) for j in range(i * 10, i * 10 + 40)] for i in range(8)]
        new = _at_once(8, lambda i: gateways[i % 2].record_usage(batches[i]))
        rows = gateways[1].usage_rows("acme")
        assert len(rows) == len({r.request_id for r in rows}) == 110  # r0 .. r109
        assert sum(new) == 110
        [total] = gateways[0].usage_summary("acme")
        assert (total.requests, total.prompt_tokens) == (110, 1100)
    finally:
        for g in gateways:
            g.close()


def test_concurrent_quota_replacements_serialise(postgres_url: str) -> None:
    gateways = [TenancyStore(postgres_url, PEPPER), TenancyStore(postgres_url, PEPPER)]
    try:
        gateways[0].create_tenant("acme")
        _at_once(8, lambda i: gateways[i % 2].set_quota("acme", Quota(rpm=i + 1)))
        rpm = gateways[1].get_quota("acme").rpm
        assert rpm is not None and 1 <= rpm <= 8
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT COUNT(*) FROM quotas").fetchone() == (1,)
    finally:
        for g in gateways:
            g.close()


def test_plaintext_key_is_nowhere_in_the_database(postgres_url: str) -> None:
    with TenancyStore(postgres_url, PEPPER) as s:
        s.create_tenant("acme")
        _, key = s.create_key("acme", "x")
    with psycopg.connect(postgres_url) as conn:
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        dump = "".join(str(conn.execute(f"SELECT json_agg(t)::text FROM {name} t").fetchone()) for name in tables)
    assert "acme" in dump  # the dump is real
    assert key not in dump and key[10:] not in dump


def test_open_store_needs_the_shared_secret_from_the_environment(postgres_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_SECRET", raising=False)
    with pytest.raises(ValueError, match="KVGATE_SECRET"):
        open_store(postgres_url)
    monkeypatch.setenv("KVGATE_SECRET", SECRET)
    store, secret = open_store(postgres_url)
    with store:
        store.create_tenant("acme")
        _, key = store.create_key("acme", "x")
    other, _ = open_store(postgres_url)  # a second gateway with the same secret accepts the key
    with other:
        assert other.authenticate(key) is not None


def test_unreachable_database_is_a_connection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_gateway_support import free_port

    monkeypatch.setattr(db_postgres, "CONNECT_TIMEOUT_S", 1.0)
    with pytest.raises(ConnectionError, match=r"\*\*\*"):
        TenancyStore(f"postgresql://u:secretpw@127.0.0.1:{free_port()}/x", PEPPER)


def test_kvgatectl_manages_a_postgres_store(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_SECRET", SECRET)
    monkeypatch.delenv("KVGATE_URL", raising=False)

    def cli(*args: str) -> Any:
        result = CliRunner().invoke(app, ["--db", postgres_url, "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    cli("tenant", "create", "acme")
    created = cli("key", "create", "acme", "--label", "ci")
    cli("quota", "set", "acme", "--rpm", "7")
    assert [t["name"] for t in cli("tenant", "list")["data"]] == ["acme"]
    with TenancyStore(postgres_url, ServerSecret(SECRET.encode()).key_pepper) as s:
        auth = s.authenticate(created["key"])
        assert auth is not None and s.get_quota("acme").rpm == 7
