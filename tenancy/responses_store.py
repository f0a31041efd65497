"""Stored Responses API objects: what ``POST /v1/responses`` keeps (unless the request says ``store: false``) so
that later requests can retrieve it, list its input items, delete it, or continue from it (``previous_response_id``).

One row per response, keyed by its id and owned by one tenant. Every read and delete names the tenant as well as the
id, so another tenant's id reads exactly like an unknown one (nothing tells a guesser that an id exists). Rows live
``retention_s`` (the gateway's ``--responses-retention-days``): reads ignore older rows at once and ``prune``
deletes them (the gateway runs it periodically), so retention holds to the second whether or not a prune has run.

It shares the tenancy store's database (SQLite or PostgreSQL, tenancy/db_backend.py) and its rules: every write is
one transaction, reads never wait behind a writer. The calls block; the gateway runs them in threads.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tenancy.db_backend import Backend

Part = Literal["body", "input_items", "context"]
_PARTS: tuple[Part, ...] = ("body", "input_items", "context")
# Ids this gateway makes are `resp_` + hex. Anything outside this shape is unknown without a query: a NUL byte in
# a path, say, would be a PostgreSQL error (a 503) instead of the 404 it deserves.
_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    tenant_id: str
    created_at: float
    body: dict[str, Any]  # the response object, as its client received it
    input_items: list[dict[str, Any]]  # this request's input items, each with its id (GET .../input_items)
    # The conversation a next turn continues from: earlier turns, this turn's input and its output, as chat
    # messages. Never the instructions: OpenAI does not carry them over to the next response.
    context: list[dict[str, Any]]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class ResponseStore:
    def __init__(self, backend: Backend, retention_s: float, *, clock: Callable[[], float] = time.time) -> None:
        if not 0 < retention_s < float("inf"):
            raise ValueError(f"response retention must be a positive number of seconds, got {retention_s}")
        self._db = backend
        self.retention_s = retention_s
        self._clock = clock

    def cutoff(self) -> float:
        """Rows created before this are expired: never read, and deleted by the next prune."""
        return self._clock() - self.retention_s

    def put(self, r: StoredResponse) -> None:
        with self._db.write() as tx:
            tx.execute("INSERT INTO responses (id, tenant_id, created_at, body, input_items, context) "
                       "VALUES (?, ?, ?, ?, ?, ?)",
                       (r.id, r.tenant_id, r.created_at, _json(r.body), _json(r.input_items), _json(r.context)))

    def read(self, tenant_id: str, response_id: str, part: Part) -> Any | None:
        """One part of a live response of ``tenant_id`` (parsed JSON), or None: unknown, expired, deleted, or
        another tenant's. Only that column is read: a long conversation's context is not loaded to show a body."""
        if part not in _PARTS:  # the column name is spliced into the SQL: only ours
            raise ValueError(f"unknown part {part!r}")
        if not _ID_RE.fullmatch(response_id):
            return None
        rows = self._db.read(f"SELECT {part} FROM responses WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                             (response_id, tenant_id, self.cutoff()))
        return json.loads(rows[0][0]) if rows else None

    def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        """The whole row (tests, tools); the gateway reads single parts with ``read``."""
        if not _ID_RE.fullmatch(response_id):
            return None
        rows = self._db.read("SELECT id, tenant_id, created_at, body, input_items, context FROM responses "
                             "WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                             (response_id, tenant_id, self.cutoff()))
        if not rows:
            return None
        rid, tid, created, body, items, context = rows[0]
        return StoredResponse(rid, tid, float(created), json.loads(body), json.loads(items), json.loads(context))

    def delete(self, tenant_id: str, response_id: str) -> bool:
        """True when a live response of ``tenant_id`` was deleted; False for the ids ``read`` does not see."""
        if not _ID_RE.fullmatch(response_id):
            return False
        with self._db.write() as tx:
            return tx.execute("DELETE FROM responses WHERE id = ? AND tenant_id = ? AND created_at >= ?",
                              (response_id, tenant_id, self.cutoff())) == 1

    def prune(self) -> int:
        """Deletes every expired row (any tenant's); returns how many."""
        with self._db.write() as tx:
            return tx.execute("DELETE FROM responses WHERE created_at < ?", (self.cutoff(),))

    def count(self, tenant_id: str | None = None) -> int:
        """Rows held, expired ones included until pruned (operators, tests)."""
        if tenant_id is None:
            rows = self._db.read("SELECT COUNT(*) FROM responses")
        else:
            rows = self._db.read("SELECT COUNT(*) FROM responses WHERE tenant_id = ?", (tenant_id,))
        return int(rows[0][0])
