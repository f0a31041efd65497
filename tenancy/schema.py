"""Versioned schema migrations for the tenancy store: one list for SQLite and PostgreSQL.

Each migration is a tuple of single statements, not a script: `executescript` would COMMIT behind our back and
break the one-transaction-per-upgrade guarantee. The statements are written in SQLite's spelling; `for_postgres`
names the one difference that matters there (REAL is single precision in PostgreSQL: a Unix time in it would be
off by minutes, so every REAL column becomes DOUBLE PRECISION). The PostgreSQL runner is in tenancy/db_postgres.py.
"""

from __future__ import annotations

import re
import sqlite3
import time

# (version, statements). Append only: never edit a migration that has shipped, add a new one.
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (1, (
        """CREATE TABLE tenants (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            status TEXT NOT NULL CHECK (status IN ('active', 'suspended')),
            weight REAL NOT NULL DEFAULT 1.0 CHECK (weight > 0),
            created_at REAL NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            label TEXT NOT NULL,
            key_hash TEXT NOT NULL UNIQUE,
            key_prefix TEXT NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL,
            revoked_at REAL
        )""",
        "CREATE INDEX api_keys_tenant ON api_keys(tenant_id)",
        # key_id NULL = the tenant-level row. NULLs are distinct in UNIQUE constraints, hence the expression index.
        """CREATE TABLE quotas (
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            key_id TEXT REFERENCES api_keys(id) ON DELETE CASCADE,
            rpm INTEGER, tpm INTEGER, max_concurrent INTEGER, token_budget INTEGER,
            budget_period TEXT CHECK (budget_period IS NULL OR budget_period IN ('day', 'month')),
            max_tokens_per_request INTEGER, max_prompt_tokens INTEGER,
            allowed_models TEXT
        )""",
        "CREATE UNIQUE INDEX quotas_scope ON quotas(tenant_id, COALESCE(key_id, ''))",
        # The ledger keeps no foreign keys: deleting a tenant must not erase what it was billed for.
        """CREATE TABLE usage (
            request_id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL,
            key_id TEXT,
            model TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            status TEXT NOT NULL,
            started_at REAL NOT NULL,
            finished_at REAL NOT NULL,
            ttft_ms REAL,
            latency_ms REAL
        )""",
        "CREATE INDEX usage_tenant_time ON usage(tenant_id, started_at)",
    )),
    # Per-key budgets are seeded from the ledger by key: without this index that is a full scan.
    (2, ("CREATE INDEX usage_key_time ON usage(key_id, started_at)",)),
    # Opt-in logging of prompt/completion text; existing tenants get the default (off), never text by surprise.
    (3, ("ALTER TABLE tenants ADD COLUMN log_text INTEGER NOT NULL DEFAULT 0 CHECK (log_text IN (0, 1))",)),
    # Stored Responses API objects (tenancy/responses_store.py). A tenant's stored responses are its data: they go
    # with it (unlike its ledger rows). JSON in TEXT columns: read whole, never queried inside.
    (4, (
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            created_at REAL NOT NULL,
            body TEXT NOT NULL,
            input_items TEXT NOT NULL,
            context TEXT NOT NULL
        )""",
        "CREATE INDEX responses_created ON responses(created_at)",
    )),
)

LATEST_VERSION = MIGRATIONS[-1][0]
VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"


def for_postgres(statement: str) -> str:
    return re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement)


def pending(have: int) -> list[tuple[int, tuple[str, ...]]]:
    """The migrations a database at version `have` still needs; refuses a database newer than this code."""
    if have > LATEST_VERSION:
        raise RuntimeError(f"database schema version {have} is newer than this kvgate supports "
                           f"({LATEST_VERSION}); upgrade kvgate")
    return [(version, statements) for version, statements in MIGRATIONS if version > have]


def current_version(conn: sqlite3.Connection) -> int:
    conn.execute(VERSION_TABLE)
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


def migrate(conn: sqlite3.Connection) -> list[int]:
    """Apply pending migrations in order, all in one transaction; returns the versions applied ([] if up to date).

    `conn` must be in autocommit mode (isolation_level=None) so that BEGIN/COMMIT here are the only boundaries.
    BEGIN IMMEDIATE takes the write lock first, so two processes opening a fresh DB cannot both migrate it.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        applied: list[int] = []
        for version, statements in pending(current_version(conn)):
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, time.time()))
            applied.append(version)
        conn.execute("COMMIT")
        return applied
    except BaseException:
        conn.execute("ROLLBACK")
        raise
