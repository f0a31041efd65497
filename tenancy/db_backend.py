"""What the tenancy store needs from a database: transactions, reads, and the few SQL spellings that differ.

TenancyStore (tenancy/store.py) writes its SQL once, with `?` placeholders and standard SQL; a backend runs it.
The dialect differences are named here, explicitly, rather than papered over by string rewriting in the store:
NULL-safe equality, the day of a Unix time, the idempotent ledger insert, and row locks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

Params = Sequence[Any]
Row = tuple[Any, ...]
_USAGE_COLUMNS = ("request_id, tenant_id, key_id, model, prompt_tokens, cached_tokens, completion_tokens, status, "
                  "started_at, finished_at, ttft_ms, latency_ms, adapter")


@dataclass(frozen=True)
class Dialect:
    name: str
    is_same: str  # NULL-safe equality operator (`key_id IS ?` in SQLite)
    day_of: str  # format string: the UTC day (YYYY-MM-DD) of a Unix-time column {}
    insert_or_ignore: str  # INSERT verb whose conflict on the primary key is a no-op
    on_conflict_nothing: str  # suffix for the same
    for_update: str  # row-lock suffix for a SELECT inside a write transaction ('' where the whole DB is locked)

    def usage_insert(self) -> str:
        """The ledger insert: a request id already there is skipped, never doubled, never an error."""
        marks = ", ".join("?" * len(_USAGE_COLUMNS.split(", ")))
        return (f"{self.insert_or_ignore} INTO usage ({_USAGE_COLUMNS}) VALUES ({marks}){self.on_conflict_nothing}")


SQLITE = Dialect("sqlite", "IS", "strftime('%Y-%m-%d', {}, 'unixepoch')", "INSERT OR IGNORE", "", "")
POSTGRES = Dialect("postgresql", "IS NOT DISTINCT FROM", "to_char(to_timestamp({}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                   "INSERT", " ON CONFLICT (request_id) DO NOTHING", " FOR UPDATE")


class Tx(Protocol):
    """One open write transaction."""

    def execute(self, sql: str, params: Params = ()) -> int:
        """Runs one statement; returns the number of rows it changed."""

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        """Runs one SELECT inside the transaction (it sees the transaction's own writes)."""

    def execute_many(self, sql: str, rows: Sequence[Params]) -> int:
        """Runs one statement per parameter row; returns the total number of rows changed."""


class Backend(Protocol):
    dialect: Dialect
    applied_migrations: list[int]
    integrity_errors: tuple[type[Exception], ...]

    def write(self) -> AbstractContextManager[Tx]:
        """A transaction that commits on a clean exit and rolls back on any exception."""

    def read(self, sql: str, params: Params = ()) -> list[Row]:
        """Committed data; must not wait behind a writer."""

    def schema_version(self) -> int: ...

    def close(self) -> None: ...


def is_url(db: str | object) -> bool:
    """`postgresql://...` / `postgres://...` select PostgreSQL; anything else is an SQLite file path."""
    return isinstance(db, str) and db.split("://", 1)[0] in ("postgresql", "postgres") and "://" in db


def redact(db: object) -> str:
    """The store's address for messages and logs: a URL's password never leaves the process."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", str(db))
