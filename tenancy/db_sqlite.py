"""SQLite (WAL) backend of the tenancy store: the embedded default, one host.

Two connections. Writes go through one, guarded by a lock: the gateway calls in from worker threads
(trio.to_thread) and SQLite allows a single writer anyway; every write is an explicit BEGIN IMMEDIATE ... COMMIT, so
it lands whole or not at all. Reads (authentication, admin listings) use a second connection with its own lock: in
WAL mode a reader never waits for a writer, so while another process holds the database (BEGIN EXCLUSIVE, a slow
disk) and the ledger writer sits in its 10 s busy timeout, key lookups still answer at once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from tenancy import schema
from tenancy.db_backend import SQLITE, Params, Row

BUSY_TIMEOUT_S = 10.0


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Params = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        return cast(list[Row], self._conn.execute(sql, params).fetchall())

    def execute_many(self, sql: str, rows: Sequence[Params]) -> int:
        before = self._conn.total_changes
        self._conn.executemany(sql, rows)
        return self._conn.total_changes - before


class SqliteBackend:
    dialect = SQLITE
    integrity_errors: tuple[type[Exception], ...] = (sqlite3.IntegrityError,)

    def __init__(self, path: str | Path) -> None:
        self._lock = threading.Lock()
        self._conn = _connect(path)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed usage batch survives power loss too, not only a process kill.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self.applied_migrations = schema.migrate(self._conn)
        self._read_lock = threading.Lock()
        self._read_conn = _connect(path)
        self._read_conn.execute("PRAGMA query_only=ON")

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._conn.close()
            self._read_conn.close()

    def schema_version(self) -> int:
        with self._lock:
            return schema.current_version(self._conn)

    @contextmanager
    def write(self) -> Iterator[_SqliteTx]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def read(self, sql: str, params: Params = ()) -> list[Row]:
        with self._read_lock:
            return cast(list[Row], self._read_conn.execute(sql, params).fetchall())


def _connect(path: str | Path) -> sqlite3.Connection:
    # Autocommit (isolation_level=None): BEGIN/COMMIT are ours alone; a lone read is its own snapshot.
    return sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
