"""Files of the Batch API (``/v1/files``): a tenant's uploaded batch input files and the output and error files its
batches produce, bytes included.

The bytes live in the database (a BLOB in SQLite, BYTEA in PostgreSQL), not on a disk beside it: with several
gateways on one PostgreSQL every gateway must serve every file, and the gateway that leads the batch runner must
read input files that another gateway received; only the database is shared by all of them, and one transaction
then covers a file and the batch that writes it. The price is memory: a file is read and written whole, so the
gateway bounds uploads (``--max-file-bytes``).

As with stored responses, every read and delete names the tenant, so another tenant's file id reads exactly like an
unknown one. The calls block; the gateway runs them in threads (``gateway.batches.stored``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any, Literal

from tenancy.db_backend import Backend, Row, Tx

Purpose = Literal["batch", "batch_output"]
Order = Literal["asc", "desc"]
_COLUMNS = "id, tenant_id, created_at, filename, purpose, size_bytes, line_count, endpoint, model"
# Ids this gateway makes are a prefix + hex. Anything else is unknown without a query (a NUL byte would be a
# PostgreSQL error, a 503, instead of the 404 it deserves).
ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant_id: str
    created_at: float
    filename: str
    purpose: Purpose  # "batch": an uploaded input file; "batch_output": a batch's output or error file
    size_bytes: int
    line_count: int
    endpoint: str | None  # an input file's endpoint (every line's url is the same); None for output files
    model: str | None = None  # an input file's model (every line's); None for output files and older uploads


def insert_file(tx: Tx, record: FileRecord, content: bytes) -> None:
    """Inside a caller's transaction (a batch's output files are written with its final state)."""
    values = (*astuple(record), content)
    tx.execute(f"INSERT INTO files ({_COLUMNS}, content) VALUES ({', '.join('?' * len(values))})", values)


def cursor_page(db: Backend, table: str, columns: str, tenant_id: str, after: str | None, limit: int, order: Order,
                where: str = "", params: Sequence[Any] = ()) -> tuple[list[Row], bool] | None:
    """Up to ``limit`` rows of the tenant in (created_at, id) order, starting after the row ``after`` names, and
    whether more follow; None when ``after`` names no row of the tenant. ``table`` and ``columns`` are ours."""
    op, direction = ("<", "DESC") if order == "desc" else (">", "ASC")
    clauses, args = ["tenant_id = ?"], [tenant_id]
    if where:
        clauses.append(where)
        args.extend(params)
    if after is not None:
        anchor = db.read(f"SELECT created_at FROM {table} WHERE id = ? AND tenant_id = ?", (after, tenant_id)) \
            if ID_RE.fullmatch(after) else []
        if not anchor:
            return None
        clauses.append(f"(created_at {op} ? OR (created_at = ? AND id {op} ?))")
        args.extend([anchor[0][0], anchor[0][0], after])
    rows = db.read(f"SELECT {columns} FROM {table} WHERE {' AND '.join(clauses)} "
                   f"ORDER BY created_at {direction}, id {direction} LIMIT ?", (*args, limit + 1))
    return rows[:limit], len(rows) > limit


class FileStore:
    def __init__(self, backend: Backend) -> None:
        self._db = backend

    def put(self, record: FileRecord, content: bytes) -> None:
        with self._db.write() as tx:
            insert_file(tx, record, content)

    def get(self, tenant_id: str, file_id: str) -> FileRecord | None:
        """The file's record, or None: unknown, deleted, or another tenant's."""
        if not ID_RE.fullmatch(file_id):
            return None
        rows = self._db.read(f"SELECT {_COLUMNS} FROM files WHERE id = ? AND tenant_id = ?", (file_id, tenant_id))
        return _record(rows[0]) if rows else None

    def content(self, tenant_id: str, file_id: str) -> bytes | None:
        if not ID_RE.fullmatch(file_id):
            return None
        rows = self._db.read("SELECT content FROM files WHERE id = ? AND tenant_id = ?", (file_id, tenant_id))
        return bytes(rows[0][0]) if rows else None  # psycopg may hand BYTEA over as a memoryview

    def page(self, tenant_id: str, *, limit: int, order: Order = "desc", after: str | None = None,
             purpose: str | None = None) -> tuple[list[FileRecord], bool] | None:
        """A page of the tenant's files and whether more follow (None: ``after`` is not one of its files)."""
        where, params = ("purpose = ?", (purpose,)) if purpose is not None else ("", ())
        found = cursor_page(self._db, "files", _COLUMNS, tenant_id, after, limit, order, where, params)
        return None if found is None else ([_record(r) for r in found[0]], found[1])

    def delete(self, tenant_id: str, file_id: str) -> bool:
        if not ID_RE.fullmatch(file_id):
            return False
        with self._db.write() as tx:
            return tx.execute("DELETE FROM files WHERE id = ? AND tenant_id = ?", (file_id, tenant_id)) == 1

    def count(self, tenant_id: str | None = None) -> int:
        """Files held (operators, tests)."""
        if tenant_id is None:
            return int(self._db.read("SELECT COUNT(*) FROM files")[0][0])
        return int(self._db.read("SELECT COUNT(*) FROM files WHERE tenant_id = ?", (tenant_id,))[0][0])


def _record(row: Row) -> FileRecord:
    fid, tid, created, filename, purpose, size, lines, endpoint, model = row
    return FileRecord(fid, tid, float(created), filename, purpose, int(size), int(lines), endpoint, model)
