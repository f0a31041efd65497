"""Batches of the Batch API (``/v1/batches``): the batch rows, their lines, and each line's result.

A batch is created ``validating``; the runner (one gateway at a time, ``tenancy.batch_lease``) copies its input
file's lines into ``batch_lines`` and moves it ``in_progress`` in one transaction (``start``), runs the lines, and
stores each line's result with its line (``put_result``): the result, the batch's counters and the line's ledger
row (billing) commit together, and only if the line had no result yet, so a line is billed at most once and only
for a stored result. A restart resumes from the lines without a result. When none is left the output and error
files are written, the batch reaches its final status and its lines are deleted, in one transaction (``finish``).

Every read a tenant makes names the tenant (another tenant's batch reads like an unknown one); the runner's calls
work across tenants. The calls block; the gateway runs them in threads (``gateway.batches.stored``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, Literal

from tenancy.db_backend import Backend, Row
from tenancy.files_store import ID_RE, FileRecord, cursor_page, insert_file
from tenancy.models import UsageRow
from tenancy.store import usage_params

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
ACTIVE: tuple[Status, ...] = ("validating", "in_progress", "finalizing", "cancelling")  # the runner's work
CANCELLABLE: tuple[Status, ...] = ("validating", "in_progress")
_TIME_OF: dict[str, str] = {s: f"{s}_at" for s in ("in_progress", "finalizing", "completed", "failed", "expired",
                                                     "cancelling", "cancelled")}
StoredFile = tuple[FileRecord, bytes]
_INSERT_CHUNK = 500  # lines per INSERT: few round trips to PostgreSQL, well under SQLite's variable limit


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant_id: str
    key_id: str  # the key that created it: its lines spend that key's (and its tenant's) quotas
    created_at: float
    status: Status
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    expires_at: float
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # why validation failed: [{code, message, line, param}]
    model: str | None = None  # the model its file's lines name; None (batches from before): the served model


_COLUMNS = ", ".join(f.name for f in fields(BatchRecord))
_JSON_COLUMNS = ("metadata", "errors")


@dataclass(frozen=True)
class PendingLine:
    line: int  # its line number in the input file (1-based, as error messages name it)
    custom_id: str
    body: str  # the request body, JSON
    attempts: int  # times a runner started it without storing a result


@dataclass(frozen=True)
class LineResult:
    line: int
    custom_id: str
    result: str | None  # the output or error file's line, JSON; None: never ran
    ok: bool | None


class _Stale(Exception):
    """The batch left the status a transaction expected (another runner or a cancel got there first)."""


class BatchStore:
    def __init__(self, backend: Backend) -> None:
        self._db = backend

    # ---- what tenants ask --------------------------------------------------------------------------

    def create(self, record: BatchRecord) -> None:
        values = [json.dumps(v) if name in _JSON_COLUMNS and v is not None else v
                  for name, v in zip(_COLUMNS.split(", "), astuple(record))]
        with self._db.write() as tx:
            tx.execute(f"INSERT INTO batches ({_COLUMNS}) VALUES ({', '.join('?' * len(values))})", values)

    def get(self, tenant_id: str, batch_id: str) -> BatchRecord | None:
        if not ID_RE.fullmatch(batch_id):
            return None
        rows = self._db.read(f"SELECT {_COLUMNS} FROM batches WHERE id = ? AND tenant_id = ?", (batch_id, tenant_id))
        return _record(rows[0]) if rows else None

    def page(self, tenant_id: str, *, limit: int, after: str | None = None) -> tuple[list[BatchRecord], bool] | None:
        """Newest first, as OpenAI lists batches (None: ``after`` is not one of the tenant's batches)."""
        found = cursor_page(self._db, "batches", _COLUMNS, tenant_id, after, limit, "desc")
        return None if found is None else ([_record(r) for r in found[0]], found[1])

    def cancel(self, tenant_id: str, batch_id: str, now: float) -> BatchRecord | None:
        """Asks for a cancel (``cancelling`` until the runner finishes it); the batch as it is now, or None."""
        if not ID_RE.fullmatch(batch_id):
            return None
        with self._db.write() as tx:
            tx.execute(f"UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND tenant_id = ? "
                       f"AND status IN ({_marks(CANCELLABLE)})", (now, batch_id, tenant_id, *CANCELLABLE))
        return self.get(tenant_id, batch_id)

    # ---- what the runner does ----------------------------------------------------------------------

    def active(self) -> list[BatchRecord]:
        """Every tenant's batches with work left, oldest first."""
        rows = self._db.read(f"SELECT {_COLUMNS} FROM batches WHERE status IN ({_marks(ACTIVE)}) "
                             "ORDER BY created_at, id", ACTIVE)
        return [_record(r) for r in rows]

    def start(self, batch_id: str, lines: Sequence[tuple[int, str, str]], now: float) -> bool:
        """``validating`` -> ``in_progress`` with its (line, custom_id, body) rows; False if it left validating."""
        try:
            with self._db.write() as tx:
                if tx.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? "
                              "WHERE id = ? AND status = 'validating'", (now, len(lines), batch_id)) != 1:
                    raise _Stale()
                for i in range(0, len(lines), _INSERT_CHUNK):
                    chunk = lines[i:i + _INSERT_CHUNK]
                    tx.execute("INSERT INTO batch_lines (batch_id, line, custom_id, body) VALUES "
                               + ", ".join(["(?, ?, ?, ?)"] * len(chunk)),
                               [v for line in chunk for v in (batch_id, *line)])
        except _Stale:
            return False
        return True

    def fail(self, batch_id: str, errors: list[dict[str, Any]], now: float) -> bool:
        """``validating`` -> ``failed`` with why (its input file could not be read as a batch)."""
        with self._db.write() as tx:
            return tx.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                              "WHERE id = ? AND status = 'validating'", (now, json.dumps(errors), batch_id)) == 1

    def pending(self, batch_id: str, after_line: int, limit: int) -> list[PendingLine]:
        rows = self._db.read("SELECT line, custom_id, body, attempts FROM batch_lines WHERE batch_id = ? AND "
                             "result IS NULL AND line > ? ORDER BY line LIMIT ?", (batch_id, after_line, limit))
        return [PendingLine(int(n), cid, body, int(attempts)) for n, cid, body, attempts in rows]

    def count_pending(self, batch_id: str) -> int:
        return int(self._db.read("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND result IS NULL",
                                 (batch_id,))[0][0])

    def mark_attempt(self, batch_id: str, line: int, now: float) -> bool:
        """Recorded before a line is submitted; False when it has a result already (nothing to run)."""
        with self._db.write() as tx:
            return tx.execute("UPDATE batch_lines SET attempts = attempts + 1, attempted_at = ? WHERE batch_id = ? "
                              "AND line = ? AND result IS NULL", (now, batch_id, line)) == 1

    def unmark_attempt(self, batch_id: str, line: int) -> None:
        """Takes back an attempt that never reached a worker (the pool refused it)."""
        with self._db.write() as tx:
            tx.execute("UPDATE batch_lines SET attempts = attempts - 1 WHERE batch_id = ? AND line = ? AND "
                       "result IS NULL AND attempts > 0", (batch_id, line))

    def put_result(self, batch_id: str, line: int, result: str, ok: bool, usage: UsageRow | None) -> bool:
        """The line's result, its batch's counters and its ledger row, together; False (nothing written) when
        the line already has a result or is gone (its batch finished)."""
        with self._db.write() as tx:
            if tx.execute("UPDATE batch_lines SET result = ?, ok = ? WHERE batch_id = ? AND line = ? AND "
                          "result IS NULL", (result, int(ok), batch_id, line)) != 1:
                return False
            tokens = (0, 0, 0) if usage is None else (usage.prompt_tokens, usage.cached_tokens,
                                                      usage.completion_tokens)
            tx.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, prompt_tokens = "
                       "prompt_tokens + ?, cached_tokens = cached_tokens + ?, completion_tokens = completion_tokens "
                       "+ ? WHERE id = ?", (int(ok), int(not ok), *tokens, batch_id))
            if usage is not None:
                tx.execute(self._db.dialect.usage_insert(), usage_params(usage))
        return True

    def results(self, batch_id: str) -> list[LineResult]:
        rows = self._db.read("SELECT line, custom_id, result, ok FROM batch_lines WHERE batch_id = ? ORDER BY line",
                             (batch_id,))
        return [LineResult(int(n), cid, result, None if ok is None else bool(ok)) for n, cid, result, ok in rows]

    def set_finalizing(self, batch_id: str, now: float) -> bool:
        with self._db.write() as tx:
            return tx.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND "
                              "status = 'in_progress'", (now, batch_id)) == 1

    def finish(self, batch_id: str, expected: Status, final: Status, now: float, output: StoredFile | None,
               error: StoredFile | None, unrun_failed: int = 0) -> bool:
        """The batch's final status with its output and error files, its lines deleted, in one transaction;
        False (nothing written) when the batch is no longer ``expected``. ``unrun_failed``: lines that never ran
        and are reported as failed (an expired batch's)."""
        try:
            with self._db.write() as tx:
                if tx.execute(f"UPDATE batches SET status = ?, {_TIME_OF[final]} = ?, output_file_id = ?, "
                              "error_file_id = ?, failed = failed + ? WHERE id = ? AND status = ?",
                              (final, now, output[0].id if output else None, error[0].id if error else None,
                               unrun_failed, batch_id, expected)) != 1:
                    raise _Stale()
                for record, content in (f for f in (output, error) if f is not None):
                    insert_file(tx, record, content)
                tx.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        except _Stale:
            return False
        return True


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def _record(row: Row) -> BatchRecord:
    values = dict(zip(_COLUMNS.split(", "), row))
    for name in _JSON_COLUMNS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    return BatchRecord(**values)
