"""The Batch API from a drill's side: upload a JSONL file, create a batch, watch it, cancel it; and what the store
holds afterwards, read straight from the spawned deployment's SQLite file (read-only), since the exactly-once
verdict must not trust the API it judges.

Reading the store: a finished batch keeps only its row, its output and error files (bytes in ``files``) and its
lines' ledger rows (request ids ``batch_req_<batch>_<line>`` in ``usage``); ``batch_lines`` rows exist only while
it runs, and a mid-run snapshot of them says which lines were attempted and which had a result.
"""

from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from chaos.target import Target

FINAL = frozenset({"completed", "failed", "cancelled", "expired"})
API_TIMEOUT_S = 60.0  # one Batch API call; uploads of a few MB are parsed in the gateway's threads
COMPLETED_STATUSES = frozenset({"stop", "length"})


def completion_lines(rng: random.Random, model: str, n: int, prompt_len: int, max_tokens: int,
                     prefix: str = "line") -> list[dict[str, Any]]:
    """``n`` /v1/completions lines of random token-id prompts (no two share a cached prefix), greedy, ignore_eos:
    every line costs exactly ``max_tokens`` completion tokens, so throughput is counted, not estimated."""
    return [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": [rng.randrange(100, 40_000) for _ in range(prompt_len)],
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}} for i in range(n)]


class BatchClient:
    """The load key's view of the Batch API over plain HTTP (the drills' own client, as for every other route)."""

    def __init__(self, client: httpx.AsyncClient, target: Target) -> None:
        self._client, self._target = client, target

    @property
    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._target.api_key}"}

    async def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        with trio.fail_after(API_TIMEOUT_S):
            r = await self._client.request(method, f"{self._target.url}{path}", headers=self._auth, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        body: dict[str, Any] = r.json()
        return body

    async def submit(self, lines: list[dict[str, Any]], endpoint: str = "/v1/completions") -> dict[str, Any]:
        """Upload ``lines`` as a file and create a batch over it; the new batch object."""
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = await self._call("POST", "/v1/files", data={"purpose": "batch"},
                                    files={"file": ("chaos.jsonl", data, "application/jsonl")})
        return await self._call("POST", "/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                             "completion_window": "24h"})

    async def get(self, batch_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/batches/{batch_id}")

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/v1/batches/{batch_id}/cancel")

    async def wait(self, batch_id: str, within: float, *, done_at_least: int | None = None) -> dict[str, Any]:
        """Poll until the batch is final, or (``done_at_least``) has that many lines with a result; the batch
        object then. Raises ``trio.TooSlowError`` past ``within``: a batch that stops moving is the finding."""
        with trio.fail_after(within):
            while True:
                batch = await self.get(batch_id)
                counts = batch.get("request_counts") or {}
                done = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
                if batch["status"] in FINAL or (done_at_least is not None and done >= done_at_least):
                    return batch
                await trio.sleep(0.1)


@dataclass(frozen=True)
class LineState:
    line: int
    attempts: int
    stored: bool  # has its result


@dataclass
class FinishedBatch:
    """A finished batch as the store holds it."""

    status: str
    total: int
    completed: int
    failed: int
    completion_tokens: int
    output: list[dict[str, Any]] = field(default_factory=list)  # the output file's lines
    errors: list[dict[str, Any]] = field(default_factory=list)  # the error file's lines
    billed: dict[str, int] = field(default_factory=dict)  # ledger: request id -> completion tokens
    billed_rows: int = 0  # rows with the batch's request ids (request ids are the ledger's key: never above)


def request_prefix(batch_id: str) -> str:
    """Its lines' request ids (and ledger keys) start with this: ``batch_req_<batch id without batch_>_``."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_"


def _connect(db_path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30.0)


def read_lines(db_path: Path, batch_id: str) -> list[LineState]:
    """The batch's lines now (empty once it finished: its lines are deleted with its final status)."""
    conn = _connect(db_path)
    try:
        rows = conn.execute("SELECT line, attempts, result IS NOT NULL FROM batch_lines WHERE batch_id = ? "
                            "ORDER BY line", (batch_id,)).fetchall()
    finally:
        conn.close()
    return [LineState(int(n), int(a), bool(s)) for n, a, s in rows]


def read_finished(db_path: Path, batch_id: str) -> FinishedBatch:
    conn = _connect(db_path)
    try:
        (status, total, completed, failed, tokens, out_id, err_id), = conn.execute(
            "SELECT status, total, completed, failed, completion_tokens, output_file_id, error_file_id FROM batches "
            "WHERE id = ?", (batch_id,)).fetchall()
        files = {}
        for file_id in (out_id, err_id):
            if file_id is not None:
                (content,), = conn.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchall()
                files[file_id] = [json.loads(line) for line in bytes(content).decode().splitlines() if line]
        usage = conn.execute("SELECT request_id, completion_tokens FROM usage WHERE request_id LIKE ?",
                             (request_prefix(batch_id) + "%",)).fetchall()
    finally:
        conn.close()
    # LIKE reads "_" as any one character: the prefix itself decides.
    usage = [(str(r), int(t)) for r, t in usage if str(r).startswith(request_prefix(batch_id))]
    return FinishedBatch(str(status), int(total), int(completed), int(failed), int(tokens),
                         files.get(out_id, []), files.get(err_id, []), dict(usage), len(usage))


def completions_logged(log_text: str, batch_id: str) -> Counter[str]:
    """How many times each of the batch's lines ran to completion on a worker, from the gateway's own
    ``request_finished`` log lines (one per attempt that ended; a SIGKILLed gateway's lines stay in the file)."""
    marker = f'"request_id":"{request_prefix(batch_id)}'
    runs: Counter[str] = Counter()
    for raw in log_text.splitlines():
        if marker not in raw or '"request_finished"' not in raw:
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            continue  # a line the kill cut in half
        if entry.get("status") in COMPLETED_STATUSES:
            runs[str(entry["request_id"])] += 1
    return runs


async def finished(target: Target, batch_id: str) -> FinishedBatch:
    if target.db_path is None:
        raise RuntimeError("reading a batch's results needs the spawned deployment's store")
    return await trio.to_thread.run_sync(read_finished, target.db_path, batch_id)


async def lines_now(target: Target, batch_id: str) -> list[LineState]:
    if target.db_path is None:
        raise RuntimeError("reading a batch's lines needs the spawned deployment's store")
    return await trio.to_thread.run_sync(read_lines, target.db_path, batch_id)
