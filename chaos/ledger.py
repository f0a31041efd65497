"""Reading the usage ledger a drill's load left behind: the rows of the load key since the drill started.

A spawned deployment's store is on this host: rows are read one by one (request id and status) from SQLite,
read-only, so a drill can match them to the responses it saw. Against ``--url`` only the admin API's per-key
totals are available (a count, no statuses). Rows of cancelled and failed requests are queued by the gateway
and committed a moment later, so readers wait for the count to settle before judging.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from chaos.target import Target

COMPLETED_STATUSES = frozenset({"stop", "length"})


@dataclass(frozen=True)
class LedgerRow:
    request_id: str
    status: str
    prompt_tokens: int
    completion_tokens: int


def _read_rows(db_path: Path, key_id: str, since: float) -> list[LedgerRow]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30.0)
    try:
        rows = conn.execute("SELECT request_id, status, prompt_tokens, completion_tokens FROM usage "
                            "WHERE key_id = ? AND started_at >= ? ORDER BY started_at", (key_id, since)).fetchall()
    finally:
        conn.close()
    return [LedgerRow(str(r[0]), str(r[1]), int(r[2]), int(r[3])) for r in rows]


async def rows(target: Target, since: float) -> list[LedgerRow] | None:
    """The load key's rows since ``since`` (unix seconds), or None when only totals can be read."""
    if target.db_path is None or target.key_id is None:
        return None
    return await trio.to_thread.run_sync(_read_rows, target.db_path, target.key_id, since)


async def count(client: httpx.AsyncClient, target: Target, since: float) -> int | None:
    """How many rows the load key has since ``since``; None when the ledger cannot be read at all."""
    found = await rows(target, since)
    if found is not None:
        return len(found)
    if not target.admin_token or not target.tenant or not target.key_id:
        return None
    body = await target.admin(client, "GET", "/usage", params={"tenant": target.tenant, "since": f"{since:.3f}",
                                                                "by": "key"})
    return sum(int(g["requests"]) for g in body["data"] if g["group"] == target.key_id)


async def settled_count(client: httpx.AsyncClient, target: Target, since: float, expect: int,
                        within: float = 30.0) -> int | None:
    """The row count once it reaches ``expect`` or stops changing for 2 s (bounded by ``within``)."""
    last = await count(client, target, since)
    if last is None:
        return None
    stable_since = trio.current_time()
    with trio.move_on_after(within):
        while last != expect and trio.current_time() - stable_since < 2.0:
            await trio.sleep(0.25)
            now = await count(client, target, since)
            if now != last:
                last, stable_since = now, trio.current_time()
    return last
