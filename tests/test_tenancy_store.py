"""tenancy.store: migrations, key lifecycle, quotas, and the usage ledger's durability.

Tests taking `store` or `db` run against both backends: SQLite (a file in tmp_path) and PostgreSQL (a fresh
database on the session's private cluster, tests/postgres_support.py). The rest are SQLite's own (its file, WAL,
a writer killed mid-session, a reader beside a locked writer); PostgreSQL's own are in test_tenancy_postgres.py.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenancy import schema
from tenancy.keys import mask_key
from tenancy.models import Quota, UsageRow
from tenancy.store import TenancyStore

ROOT = Path(__file__).resolve().parents[1]
PEPPER = b"test-pepper"


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a store lives: an SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "kvgate.db")
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def store(db: str, clock: FakeClock) -> Iterator[TenancyStore]:
    s = TenancyStore(db, PEPPER, clock=clock)
    yield s
    s.close()


def _raw_execute(db: str, sql: str) -> None:
    """One statement on the store's database behind the store's back (no placeholders)."""
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(sql.encode())
        return
    conn = sqlite3.connect(db)
    conn.execute(sql)
    conn.commit()
    conn.close()


def _row(rid: str, tenant_id: str, **kw: object) -> UsageRow:
    base: dict[str, object] = dict(request_id=rid, tenant_id=tenant_id, key_id=None, model="smollm2",
                                   prompt_tokens=10, cached_tokens=0, completion_tokens=5, status="stop",
                                   started_at=1_700_000_000.0, finished_at=1_700_000_001.0)
    base.update(kw)
    return UsageRow(**base)  # type: ignore[arg-type]


# --- migrations ----------------------------------------------------------------------------------------------

def test_fresh_db_is_migrated_in_wal_mode_and_version_recorded(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    with TenancyStore(path, PEPPER) as s:
        assert s.applied_migrations == [v for v, _ in schema.MIGRATIONS]
        assert s.schema_version == schema.LATEST_VERSION
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"schema_version", "tenants", "api_keys", "quotas", "usage"} <= tables
    assert conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == [
        (v,) for v, _ in schema.MIGRATIONS]


def test_reopening_up_to_date_db_is_a_noop_and_keeps_data(db: str) -> None:
    with TenancyStore(db, PEPPER) as s:
        assert s.applied_migrations == [v for v, _ in schema.MIGRATIONS]
        s.create_tenant("acme")
    with TenancyStore(db, PEPPER) as s:
        assert s.applied_migrations == []
        assert s.schema_version == schema.LATEST_VERSION
        assert [t.name for t in s.list_tenants()] == ["acme"]


def test_version_1_db_upgrades_in_place_and_keeps_data(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    schema.current_version(conn)
    for statement in schema.MIGRATIONS[0][1]:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (1, 0)")
    conn.execute("INSERT INTO tenants VALUES ('ten_0', 'old', 'active', 1.0, 0)")
    conn.execute("COMMIT")
    conn.close()
    with TenancyStore(path, PEPPER) as s:
        assert s.applied_migrations == [v for v, _ in schema.MIGRATIONS[1:]]
        assert [t.name for t in s.list_tenants()] == ["old"]
    indexes = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "usage_key_time" in indexes


def test_version_2_db_gains_log_text_off_for_existing_tenants(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    schema.current_version(conn)
    for version, statements in schema.MIGRATIONS[:2]:
        for statement in statements:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version VALUES (?, 0)", (version,))
    conn.execute("INSERT INTO tenants VALUES ('ten_0', 'old', 'active', 2.0, 0)")
    conn.execute("INSERT INTO api_keys (id, tenant_id, label, key_hash, key_prefix, created_at) "
                 "VALUES ('key_0', 'ten_0', 'x', 'h', 'p', 0)")
    conn.execute("COMMIT")
    conn.close()
    with TenancyStore(path, PEPPER) as s:
        assert s.applied_migrations == [v for v, _ in schema.MIGRATIONS[2:]]
        assert s.schema_version == schema.LATEST_VERSION
        old = s.get_tenant("old")
        assert (old.id, old.weight, old.log_text) == ("ten_0", 2.0, False)
        assert [k.id for k in s.list_keys("old")] == ["key_0"]
        assert s.set_log_text("old", True).log_text is True
    raw = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError):
        raw.execute("UPDATE tenants SET log_text = 2")  # the column holds 0 or 1 only
    raw.close()


def test_db_newer_than_code_is_refused(db: str) -> None:
    TenancyStore(db, PEPPER).close()
    _raw_execute(db, f"INSERT INTO schema_version VALUES ({schema.LATEST_VERSION + 1}, 0)")
    with pytest.raises(RuntimeError, match="newer"):
        TenancyStore(db, PEPPER)


# --- tenants and keys ----------------------------------------------------------------------------------------

def test_tenant_crud_and_validation(store: TenancyStore) -> None:
    t = store.create_tenant("acme", weight=3)
    assert store.get_tenant("acme") == store.get_tenant(t.id) == t
    with pytest.raises(ValueError, match="already exists"):
        store.create_tenant("acme")
    for bad in ("", "has space", "ten_x", "-x"):
        with pytest.raises(ValueError):
            store.create_tenant(bad)
    with pytest.raises(ValueError, match="weight"):
        store.create_tenant("zero", weight=0)
    assert store.suspend_tenant("acme").status == "suspended"
    assert store.resume_tenant(t.id).status == "active"
    store.delete_tenant("acme")
    assert store.find_tenant("acme") is None
    with pytest.raises(KeyError):
        store.get_tenant("acme")


def test_key_lifecycle(store: TenancyStore, clock: FakeClock) -> None:
    t = store.create_tenant("acme")
    key_id, key = store.create_key("acme", "ci")
    assert key.startswith("kvg-") and len(key) >= 4 + 43  # 32 random bytes, urlsafe base64
    auth = store.authenticate(key)
    assert auth is not None and (auth.tenant_id, auth.key_id, auth.tenant_status) == (t.id, key_id, "active")
    assert store.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert store.authenticate("kvg-unknown") is None
    assert store.authenticate("sk-not-ours") is None

    assert store.revoke_key(key_id) is True
    assert store.revoke_key(key_id) is False
    assert store.authenticate(key) is None
    with pytest.raises(KeyError):
        store.revoke_key("key_missing")

    exp_id, exp_key = store.create_key("acme", "short", expires_at=clock.t + 60)
    assert store.authenticate(exp_key) is not None
    clock.t += 60
    assert store.authenticate(exp_key) is None
    with pytest.raises(ValueError, match="past"):
        store.create_key("acme", "late", expires_at=clock.t - 1)

    listed = {k.id: k for k in store.list_keys("acme")}
    assert set(listed) == {key_id, exp_id}
    assert listed[key_id].revoked_at is not None and listed[exp_id].expires_at == clock.t
    assert listed[key_id].key_prefix == key[:10]
    assert not any(hasattr(k, "key_hash") for k in listed.values())


def test_plaintext_key_never_reaches_the_db_file(tmp_path: Path) -> None:
    path = tmp_path / "k.db"
    with TenancyStore(path, PEPPER) as s:
        s.create_tenant("acme")
        _, key = s.create_key("acme", "x")
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("k.db"))
    assert key.encode() not in blob
    assert key[10:].encode() not in blob  # not even the part after the display prefix


def test_pepper_matters(db: str) -> None:
    with TenancyStore(db, PEPPER) as s:
        s.create_tenant("acme")
        _, key = s.create_key("acme", "x")
    with TenancyStore(db, b"another-pepper") as s:
        assert s.authenticate(key) is None


def test_suspended_tenant_is_flagged_not_hidden(store: TenancyStore) -> None:
    store.create_tenant("acme")
    _, key = store.create_key("acme", "x")
    store.suspend_tenant("acme")
    auth = store.authenticate(key)
    assert auth is not None and auth.tenant_status == "suspended"


def test_set_log_text_by_name_or_id_reaches_authentication(store: TenancyStore) -> None:
    t = store.create_tenant("acme")
    _, key = store.create_key("acme", "x")
    assert t.log_text is False and store.get_tenant("acme").log_text is False
    auth = store.authenticate(key)
    assert auth is not None and auth.log_text is False
    on = store.set_log_text("acme", True)
    assert on == store.get_tenant(t.id) and on.log_text is True and on.weight == t.weight
    auth = store.authenticate(key)
    assert auth is not None and auth.log_text is True
    assert [x.log_text for x in store.list_tenants()] == [True]
    assert store.set_log_text(t.id, False).log_text is False
    with pytest.raises(KeyError):
        store.set_log_text("nope", True)
    with pytest.raises(ValueError, match="bool"):
        store.set_log_text("acme", "off")  # type: ignore[arg-type]
    assert store.get_tenant("acme").log_text is False


def test_delete_tenant_kills_its_keys_keeps_its_usage(store: TenancyStore) -> None:
    t = store.create_tenant("acme")
    _, key = store.create_key("acme", "x")
    store.record_usage([_row("r1", t.id)])
    store.delete_tenant("acme")
    assert store.authenticate(key) is None
    store.create_tenant("acme")
    assert store.usage_rows("acme") == []  # a new tenant of the same name is not billed for the old one


def test_mask_key() -> None:
    assert mask_key("kvg-abcdefghijklmnopqrstuvwxyz") == "kvg-abcd...wxyz"
    assert mask_key("short") == "***"


# --- quotas --------------------------------------------------------------------------------------------------

def test_quota_defaults_unlimited_and_key_overrides_field_by_field(store: TenancyStore) -> None:
    store.create_tenant("acme")
    key_id, _ = store.create_key("acme", "x")
    assert store.get_quota("acme") == Quota()
    store.set_quota("acme", Quota(rpm=60, tpm=1000, allowed_models=("smollm2",)))
    store.set_quota("acme", Quota(tpm=100, max_concurrent=2), key_id=key_id)
    assert store.get_quota("acme") == Quota(rpm=60, tpm=1000, allowed_models=("smollm2",))
    assert store.get_quota("acme", key_id) == Quota(rpm=60, tpm=100, max_concurrent=2, allowed_models=("smollm2",))
    store.set_quota("acme", Quota(rpm=5))  # replaces the tenant row whole
    assert store.get_quota("acme") == Quota(rpm=5)
    other = store.create_tenant("other")
    with pytest.raises(KeyError):
        store.set_quota(other.id, Quota(rpm=1), key_id=key_id)


def test_quota_validation() -> None:
    with pytest.raises(ValueError, match="rpm"):
        Quota(rpm=0)
    with pytest.raises(ValueError, match="budget_period"):
        Quota(token_budget=100)
    with pytest.raises(ValueError):
        Quota(budget_period="week")  # type: ignore[arg-type]


# --- usage ledger --------------------------------------------------------------------------------------------

def test_usage_group_commit_is_idempotent_and_survives_reopen(db: str) -> None:
    with TenancyStore(db, PEPPER) as s:
        t = s.create_tenant("acme")
        batch = [_row(f"r{i}", t.id) for i in range(50)]
        assert s.record_usage(batch) == 50
        assert s.record_usage(batch[40:] + [_row("r50", t.id)]) == 1  # a retried batch: no doubles
        assert s.record_usage([]) == 0
    with TenancyStore(db, PEPPER) as s:
        rows = s.usage_rows("acme")
        assert len(rows) == 51 and len({r.request_id for r in rows}) == 51
        [total] = s.usage_summary("acme")
        assert (total.requests, total.prompt_tokens, total.completion_tokens) == (51, 510, 255)


def test_usage_batch_with_bad_row_commits_nothing(store: TenancyStore) -> None:
    t = store.create_tenant("acme")
    with pytest.raises(ValueError):
        store.record_usage([_row("ok", t.id), _row("bad", t.id, prompt_tokens=-1)])
    assert store.usage_rows("acme") == []


def test_usage_queries_by_tenant_since_and_grouping(store: TenancyStore) -> None:
    a, b = store.create_tenant("a"), store.create_tenant("b")
    day = 86400.0
    t0 = 1_700_006_400.0  # 2023-11-15 00:00 UTC
    store.record_usage([
        _row("a1", a.id, key_id="k1", model="m1", started_at=t0),
        _row("a2", a.id, key_id="k2", model="m2", started_at=t0 + 10, cached_tokens=4),
        _row("a3", a.id, key_id="k1", model="m1", started_at=t0 + day),
        _row("b1", b.id, model="m1", started_at=t0),
    ])
    assert [(g.group, g.requests) for g in store.usage_summary("a", by="day")] == [("2023-11-15", 2),
                                                                                   ("2023-11-16", 1)]
    assert [(g.group, g.requests) for g in store.usage_summary("a", by="model")] == [("m1", 2), ("m2", 1)]
    by_key = {g.group: g for g in store.usage_summary("a", by="key")}
    assert by_key["k2"].cached_tokens == 4 and by_key["k1"].requests == 2
    assert [g.requests for g in store.usage_summary("a", since=t0 + 5)] == [2]
    assert [g.requests for g in store.usage_summary()] == [4]
    assert [r.request_id for r in store.usage_rows("b")] == ["b1"]
    assert store.tokens_used("a", since=t0 + day) == 15
    with pytest.raises(ValueError, match="grouping"):
        store.usage_summary("a", by="week")  # type: ignore[arg-type]


_WRITER = textwrap.dedent("""
    import os, sys
    from tenancy.models import UsageRow
    from tenancy.store import TenancyStore
    s = TenancyStore(sys.argv[1], b"test-pepper")
    t = s.create_tenant("acme")
    s.record_usage([UsageRow(f"r{i}", t.id, None, "m", 3, 1, 2, "stop", 1.0, 2.0) for i in range(20)])
    print("committed", flush=True)
    sys.stdin.readline()  # hold the connection open (no clean close, no checkpoint) until killed
""")


def test_committed_usage_survives_sigkill_of_writer(tmp_path: Path) -> None:
    path = tmp_path / "crash.db"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "committed"
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
    reader = ("import sys; from tenancy.store import TenancyStore;"
              "s = TenancyStore(sys.argv[1], b'test-pepper'); print(len(s.usage_rows('acme')))")
    out = subprocess.run([sys.executable, "-c", reader, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout.strip() == "20"


def test_tenancy_does_not_import_forbidden_packages() -> None:
    code = ("import sys, tenancy.store, tenancy.limiter;"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert not set(out.stdout.split()) & {"torch", "workers", "gateway"}


def test_scope_tokens_used_counts_prompt_and_completion_by_tenant_and_key(store: TenancyStore) -> None:
    a = store.create_tenant("a")
    k1, _ = store.create_key("a", "one")
    k2, _ = store.create_key("a", "two")
    store.record_usage([_row("r1", a.id, key_id=k1, started_at=100.0), _row("r2", a.id, key_id=k2, started_at=200.0),
                        _row("r3", "ten_other", key_id=None, started_at=200.0)])
    per_row = _row("x", a.id).prompt_tokens + _row("x", a.id).completion_tokens
    assert store.scope_tokens_used(f"tenant:{a.id}", 0.0) == 2 * per_row
    assert store.scope_tokens_used(f"tenant:{a.id}", 150.0) == per_row
    assert store.scope_tokens_used(f"key:{k1}", 0.0) == per_row
    assert store.scope_tokens_used(f"key:{k2}", 250.0) == 0
    with pytest.raises(ValueError):
        store.scope_tokens_used("team:x", 0.0)


def test_quota_rows_are_unmerged(store: TenancyStore) -> None:
    store.create_tenant("a")
    k, _ = store.create_key("a", "one")
    store.set_quota("a", Quota(rpm=10, tpm=1000))
    assert store.quota_rows("a", k) == (Quota(rpm=10, tpm=1000), None)
    store.set_quota("a", Quota(tpm=50), key_id=k)
    assert store.quota_rows("a", k) == (Quota(rpm=10, tpm=1000), Quota(tpm=50))
    assert store.quota_rows("a") == (Quota(rpm=10, tpm=1000), None)


def test_usage_times_keep_sub_second_precision(store: TenancyStore) -> None:
    """A Unix time needs double precision (PostgreSQL's REAL would round it to minutes)."""
    t = store.create_tenant("acme")
    store.record_usage([_row("r1", t.id, started_at=1_700_000_000.125, finished_at=1_700_000_000.5)])
    [row] = store.usage_rows("acme")
    assert (row.started_at, row.finished_at) == (1_700_000_000.125, 1_700_000_000.5)


def test_key_lookup_answers_while_another_process_holds_the_write_lock(tmp_path: Path) -> None:
    """The chaos drills' finding: a writer stuck in the busy timeout must not stall authentication. Another
    connection holds BEGIN EXCLUSIVE; the ledger writer waits for it, and a key lookup still answers."""
    path = tmp_path / "locked.db"
    with TenancyStore(path, PEPPER) as s:
        t = s.create_tenant("acme")
        _, key = s.create_key("acme", "x")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        writer_started, writer_done = threading.Event(), threading.Event()

        def write() -> None:
            writer_started.set()
            try:
                s.record_usage([_row("r1", t.id)])  # waits in the busy timeout while the holder has the lock
            finally:
                writer_done.set()

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        try:
            writer_started.wait()
            # The writer holds the store's write lock for as long as it sits in SQLite's busy timeout.
            while not s._db._lock.locked():  # type: ignore[attr-defined]
                threading.Event().wait(0.005)
            auth = s.authenticate(key)
            tenants = [x.name for x in s.list_tenants()]
            still_locked = not writer_done.is_set()  # the lookups returned while the writer still waited
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            thread.join()
        assert auth is not None and auth.tenant_id == t.id and tenants == ["acme"]
        assert still_locked
        assert [r.request_id for r in s.usage_rows("acme")] == ["r1"]  # the writer landed once the lock went
