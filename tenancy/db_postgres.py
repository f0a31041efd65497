"""PostgreSQL backend of the tenancy store: one database shared by every gateway of a deployment.

A psycopg 3 connection pool (psycopg_pool) in autocommit mode: a lone read is one statement, a write is an explicit
transaction (`conn.transaction()`: commit on a clean exit, rollback on an exception). Concurrency between gateways
is the database's job: the ledger insert is ON CONFLICT (request_id) DO NOTHING, a quota replacement locks its
tenant's row first (SELECT ... FOR UPDATE), and migrations run under a transaction-scoped advisory lock so two
gateways starting on a fresh database cannot both migrate it. psycopg is imported only when a URL asks for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from tenancy import schema
from tenancy.db_backend import POSTGRES, Params, Row, redact

CONNECT_TIMEOUT_S = 10.0
POOL_MAX = 8  # the gateway's to_thread callers and the ledger writer; more would only queue in the server
_MIGRATION_LOCK = 0x6B76_6761_7465  # "kvgate": an advisory lock id no other application is likely to pick


def _sql(statement: str) -> str:
    """Our `?` placeholders in psycopg's spelling (a literal % must be doubled there)."""
    return statement.replace("%", "%%").replace("?", "%s")


class _PgTx:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Params = ()) -> int:
        return self._conn.execute(_sql(sql), params).rowcount

    def query(self, sql: str, params: Params = ()) -> list[Row]:
        return cast(list[Row], self._conn.execute(_sql(sql), params).fetchall())

    def execute_many(self, sql: str, rows: Sequence[Params]) -> int:
        # One statement per row inside the one transaction: each row's own rowcount says whether it was new.
        statement = _sql(sql)
        return sum(self._conn.execute(statement, row).rowcount for row in rows)


class PostgresBackend:
    dialect = POSTGRES
    integrity_errors: tuple[type[Exception], ...] = (psycopg.IntegrityError,)

    def __init__(self, url: str, *, max_size: int = POOL_MAX) -> None:
        self._pool = ConnectionPool(url, min_size=1, max_size=max_size, kwargs={"autocommit": True},
                                    check=ConnectionPool.check_connection, open=False,
                                    name=f"kvgate-store {redact(url)}")
        self._pool.open(wait=False)
        try:
            self._pool.wait(timeout=CONNECT_TIMEOUT_S)
        except PoolTimeout:
            self._pool.close()
            # ConnectionError (an OSError): callers that report an unopenable SQLite file report this too.
            raise ConnectionError(f"no PostgreSQL connection to {redact(url)} within {CONNECT_TIMEOUT_S:.0f} s") \
                from None
        try:
            self.applied_migrations = self._migrate()
        except BaseException:
            self._pool.close()
            raise

    def close(self) -> None:
        self._pool.close()

    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            return _version(conn)

    @contextmanager
    def write(self) -> Iterator[_PgTx]:
        with self._pool.connection() as conn, conn.transaction():
            yield _PgTx(conn)

    def read(self, sql: str, params: Params = ()) -> list[Row]:
        with self._pool.connection() as conn:
            return conn.execute(_sql(sql), params).fetchall()

    def _migrate(self) -> list[int]:
        """Pending migrations in one transaction, serialised across processes by an advisory lock."""
        applied: list[int] = []
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            for version, statements in schema.pending(_version(conn)):
                for statement in statements:
                    conn.execute(schema.for_postgres(statement))
                conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (%s, %s)",
                             (version, time.time()))
                applied.append(version)
        return applied


def _version(conn: psycopg.Connection[Any]) -> int:
    conn.execute(schema.for_postgres(schema.VERSION_TABLE))
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0
