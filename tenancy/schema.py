"""Versioned schema migrations for the tenancy store: one list for SQLite and PostgreSQL.

Each migration is a tuple of single statements, not a script: `executescript` would COMMIT behind our back and
break the one-transaction-per-upgrade guarantee. The statements are written in SQLite's spelling; `for_postgres`
names the two differences that matter there (REAL is single precision in PostgreSQL: a Unix time in it would be
off by minutes, so every REAL column becomes DOUBLE PRECISION; PostgreSQL has no BLOB, its bytes are BYTEA). The
PostgreSQL runner is in tenancy/db_postgres.py.
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
    # The Batch API (tenancy/files_store.py, tenancy/batch_store.py). Files keep their bytes in the database: every
    # gateway on a shared PostgreSQL serves them and whichever gateway leads the batch runner reads them. A batch's
    # lines are rows of their own so that each result lands in its own transaction (a restart resumes from them);
    # they are deleted when the batch's output and error files are written. One lease row names the gateway that
    # runs batches.
    (5, (
        """CREATE TABLE files (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            created_at REAL NOT NULL,
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,
            size_bytes INTEGER NOT NULL,
            line_count INTEGER NOT NULL,
            endpoint TEXT,
            content BLOB NOT NULL
        )""",
        "CREATE INDEX files_tenant ON files(tenant_id, created_at)",
        """CREATE TABLE batches (
            id TEXT PRIMARY KEY,
            tenant_id TEXT NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            key_id TEXT NOT NULL,
            created_at REAL NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed',
                                                   'expired', 'cancelling', 'cancelled')),
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            metadata TEXT,
            expires_at REAL NOT NULL,
            in_progress_at REAL, finalizing_at REAL, completed_at REAL, failed_at REAL, expired_at REAL,
            cancelling_at REAL, cancelled_at REAL,
            total INTEGER NOT NULL DEFAULT 0,
            completed INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0,
            prompt_tokens INTEGER NOT NULL DEFAULT 0,
            cached_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            output_file_id TEXT,
            error_file_id TEXT,
            errors TEXT
        )""",
        "CREATE INDEX batches_tenant ON batches(tenant_id, created_at)",
        "CREATE INDEX batches_status ON batches(status)",
        """CREATE TABLE batch_lines (
            batch_id TEXT NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
            line INTEGER NOT NULL,
            custom_id TEXT NOT NULL,
            body TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            attempted_at REAL,
            result TEXT,
            ok INTEGER,
            PRIMARY KEY (batch_id, line)
        )""",
        "CREATE TABLE batch_lease (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at REAL NOT NULL)",
    )),
    # Tenant tiers (tenancy/tiers.py): every existing tenant is 'standard', whose priority (0) and admission share
    # (the bounds as configured) are what every request had before tiers, so the upgrade changes no one's service.
    (6, ("ALTER TABLE tenants ADD COLUMN tier TEXT NOT NULL DEFAULT 'standard' "
         "CHECK (tier IN ('interactive', 'standard', 'batch'))",)),
    # LoRA adapters registered by an operator (tenancy/adapters_store.py): the name clients send as `model`, the
    # directory under the gateway's --lora-dir the workers load it from, and its owner (NULL: every tenant may use
    # it). A tenant's adapters go with it. The ledger gains the adapter a request ran with; NULL (every row from
    # before, and every base-model request) is the base model.
    (7, (
        """CREATE TABLE lora_adapters (
            name TEXT PRIMARY KEY,
            path TEXT NOT NULL,
            tenant_id TEXT REFERENCES tenants(id) ON DELETE CASCADE,
            created_at REAL NOT NULL
        )""",
        "CREATE INDEX lora_adapters_tenant ON lora_adapters(tenant_id)",
        "ALTER TABLE usage ADD COLUMN adapter TEXT",
    )),
    # The model a batch file's lines name (one a file) and the model of a batch made from it: the key's model
    # allowlist is checked against it (a key allowed only an adapter can upload and run a file for that adapter)
    # and the batch object reports it. NULL (files and batches from before): the served model, which is what
    # they were checked against.
    (8, ("ALTER TABLE files ADD COLUMN model TEXT", "ALTER TABLE batches ADD COLUMN model TEXT")),
)

LATEST_VERSION = MIGRATIONS[-1][0]
VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"


def for_postgres(statement: str) -> str:
    return re.sub(r"\bBLOB\b", "BYTEA", re.sub(r"\bREAL\b", "DOUBLE PRECISION", statement))


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
