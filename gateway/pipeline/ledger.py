"""The usage ledger writer: group commit of one row per request into the tenancy store.

One task owns the queue and the store's write path. A request that completed awaits ``record`` before its final
chunk leaves, so a response the client saw end is durable even if the gateway is SIGKILLed right after; many
requests finishing together share one transaction and one fsync. Rows of requests that ended otherwise
(cancelled, failed) are queued with ``record_nowait`` from ``finally`` blocks. A failed commit keeps its rows
queued and is retried; the store's INSERT OR IGNORE on request_id makes a retried batch neither lose nor double
a row. On shutdown the queue is flushed under a shielded deadline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import trio

from tenancy.models import UsageRow

log = logging.getLogger("kvgate.gateway.ledger")

MAX_BATCH = 512
COMMIT_WAIT_S = 5.0  # a request waits this long for its row to commit before its final chunk goes anyway
SHUTDOWN_FLUSH_S = 10.0
RETRY_BACKOFF_S = (0.1, 0.5, 2.0)


class UsageLedger:
    def __init__(self, record_usage: Callable[[Sequence[UsageRow]], int]) -> None:
        self._record_usage = record_usage  # TenancyStore.record_usage: blocking (fsync), run in a thread
        # Unbounded on purpose: a usage row is billing data and is never dropped or refused (recording must
        # stay sync for cancelled tasks' ``finally``). Rows arrive at most once per admitted request, so the
        # depth is bounded by admission while the store works; while it does not (disk full, locked), the
        # depth is exported as kvgate:ledger_queue for the operator.
        self._tx, self._rx = trio.open_memory_channel[tuple[UsageRow, trio.Event]](math.inf)
        self._retry: list[tuple[UsageRow, trio.Event]] = []  # a batch whose commit failed, first in line
        self.committed = 0  # rows committed by this process (new rows only)
        self.failures = 0  # commits that raised (rows were kept and retried)

    @property
    def queued(self) -> int:
        return self._rx.statistics().current_buffer_used + len(self._retry)

    def record_nowait(self, row: UsageRow) -> trio.Event:
        """Queue a row (sync, never blocks: callable from a cancelled task's ``finally``); the event is set
        once it is committed."""
        done = trio.Event()
        self._tx.send_nowait((row, done))
        return done

    async def record(self, row: UsageRow) -> bool:
        """Queue a row and wait until it is committed; False when that took longer than COMMIT_WAIT_S (the
        row stays queued and will still be written)."""
        done = self.record_nowait(row)
        with trio.move_on_after(COMMIT_WAIT_S):
            await done.wait()
            return True
        log.error("usage row for %s not committed after %.0fs; still queued", row.request_id, COMMIT_WAIT_S)
        return False

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            failures = 0
            while True:
                if not self._retry:
                    self._retry.append(await self._rx.receive())
                if await self._commit_batch():
                    failures = 0
                else:
                    await trio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S) - 1)])
                    failures += 1
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_FLUSH_S):
                while self.queued and await self._commit_batch():
                    pass
            if self.queued:
                log.error("shutting down with %d usage rows not committed", self.queued)

    async def _commit_batch(self) -> bool:
        batch, self._retry = self._retry[:MAX_BATCH], self._retry[MAX_BATCH:]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._rx.receive_nowait())
            except trio.WouldBlock:
                break
        if not batch:
            return True
        try:
            # Not abandoned on cancel: a commit that started finishes, so its waiters learn the truth.
            self.committed += await trio.to_thread.run_sync(self._record_usage, [row for row, _ in batch])
        except Exception as e:  # noqa: BLE001 - disk full, database locked too long: keep the rows, retry
            self.failures += 1
            log.error("usage commit of %d rows failed (%s: %s); will retry", len(batch), type(e).__name__, e)
            self._retry[:0] = batch
            return False
        for _, done in batch:
            done.set()
        return True
