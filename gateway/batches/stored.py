"""The gateway's side of the Batch API's tables (``tenancy.files_store``, ``tenancy.batch_store``,
``tenancy.batch_lease``): every call in a worker thread under a deadline, so the event loop never waits on the
database; failures as OpenAI-shaped 503s (``store_unavailable``), logged by type only (a database's message may
quote the values written).

A call past its deadline is abandoned rather than waited for (a hung database must not hold a request, the runner
or a shutdown): its thread finishes on its own and its answer is dropped. Each write is idempotent or conditional,
so one that lands after being abandoned is harmless: an abandoned ``put_result`` that commits later leaves the line
with its result (it is then not run again), one that does not leaves it pending (it runs again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from gateway.base.errors import APIError, store_unavailable
from tenancy.batch_lease import BatchLease
from tenancy.batch_store import BatchRecord, BatchStore, LineResult, PendingLine, Status, StoredFile
from tenancy.db_backend import Backend
from tenancy.files_store import FileRecord, FileStore, Order
from tenancy.models import UsageRow

log = logging.getLogger("kvgate.gateway.batches")
T = TypeVar("T")

STORE_TIMEOUT_S = 10.0  # the SQLite busy timeout: a write waiting longer than this is not coming
BULK_TIMEOUT_S = 120.0  # whole files: an upload's bytes, a batch's lines copied in, its output files written


class StoredBatches:
    def __init__(self, backend: Backend, lease_holder: str, lease_ttl_s: float, *,
                 timeout_s: float = STORE_TIMEOUT_S, bulk_timeout_s: float = BULK_TIMEOUT_S) -> None:
        self.files = FileStore(backend)
        self.batches = BatchStore(backend)
        self.lease = BatchLease(backend, lease_holder, lease_ttl_s)
        self._timeout_s, self._bulk_timeout_s = timeout_s, bulk_timeout_s

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, bulk: bool = False) -> T:
        timeout = self._bulk_timeout_s if bulk else self._timeout_s
        try:
            with trio.fail_after(timeout):
                return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except trio.TooSlowError:
            log.error("batch store: %s took over %.0fs; abandoned", what, timeout)
            raise store_unavailable("the batch store is unavailable; retry the request") from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the database raised: a 503 for the client, the log why
            log.error("batch store: %s failed (%s, sqlstate %s)", what, type(e).__name__, getattr(e, "sqlstate", None))
            raise store_unavailable("the batch store is unavailable; retry the request") from None

    # ---- files -------------------------------------------------------------------------------------

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        await self._call("put file", self.files.put, record, content, bulk=True)

    async def file(self, tenant_id: str, file_id: str) -> FileRecord | None:
        return await self._call("read file", self.files.get, tenant_id, file_id)

    async def file_content(self, tenant_id: str, file_id: str) -> bytes | None:
        return await self._call("read file content", self.files.content, tenant_id, file_id, bulk=True)

    async def file_page(self, tenant_id: str, limit: int, order: Order, after: str | None,
                        purpose: str | None) -> tuple[list[FileRecord], bool] | None:
        return await self._call("list files", lambda: self.files.page(tenant_id, limit=limit, order=order,
                                                                      after=after, purpose=purpose))

    async def delete_file(self, tenant_id: str, file_id: str) -> bool:
        return await self._call("delete file", self.files.delete, tenant_id, file_id)

    # ---- batches, as tenants see them --------------------------------------------------------------

    async def create_batch(self, record: BatchRecord) -> None:
        await self._call("create batch", self.batches.create, record)

    async def batch(self, tenant_id: str, batch_id: str) -> BatchRecord | None:
        return await self._call("read batch", self.batches.get, tenant_id, batch_id)

    async def batch_page(self, tenant_id: str, limit: int, after: str | None) -> tuple[list[BatchRecord], bool] | None:
        return await self._call("list batches", lambda: self.batches.page(tenant_id, limit=limit, after=after))

    async def cancel_batch(self, tenant_id: str, batch_id: str, now: float) -> BatchRecord | None:
        return await self._call("cancel batch", self.batches.cancel, tenant_id, batch_id, now)

    # ---- the runner --------------------------------------------------------------------------------

    async def acquire_lease(self) -> bool:
        return await self._call("take the runner lease", self.lease.acquire)

    async def renew_lease(self) -> bool:
        return await self._call("renew the runner lease", self.lease.renew)

    async def release_lease(self) -> None:
        await self._call("release the runner lease", self.lease.release)

    async def active(self) -> list[BatchRecord]:
        return await self._call("list active batches", self.batches.active)

    async def start(self, batch_id: str, lines: Sequence[tuple[int, str, str]], now: float) -> bool:
        return await self._call("start batch", self.batches.start, batch_id, lines, now, bulk=True)

    async def fail(self, batch_id: str, errors: list[dict[str, Any]], now: float) -> bool:
        return await self._call("fail batch", self.batches.fail, batch_id, errors, now)

    async def pending(self, batch_id: str, after_line: int, limit: int) -> list[PendingLine]:
        return await self._call("read pending lines", self.batches.pending, batch_id, after_line, limit)

    async def count_pending(self, batch_id: str) -> int:
        return await self._call("count pending lines", self.batches.count_pending, batch_id)

    async def mark_attempt(self, batch_id: str, line: int, now: float) -> bool:
        return await self._call("mark a line's attempt", self.batches.mark_attempt, batch_id, line, now)

    async def unmark_attempt(self, batch_id: str, line: int) -> None:
        await self._call("take back a line's attempt", self.batches.unmark_attempt, batch_id, line)

    async def put_result(self, batch_id: str, line: int, result: str, ok: bool, usage: UsageRow | None) -> bool:
        return await self._call("store a line's result", self.batches.put_result, batch_id, line, result, ok, usage)

    async def results(self, batch_id: str) -> list[LineResult]:
        return await self._call("read results", self.batches.results, batch_id, bulk=True)

    async def set_finalizing(self, batch_id: str, now: float) -> bool:
        return await self._call("finalize batch", self.batches.set_finalizing, batch_id, now)

    async def finish(self, batch_id: str, expected: Status, final: Status, now: float, output: StoredFile | None,
                     error: StoredFile | None, unrun_failed: int) -> bool:
        return await self._call("finish batch", self.batches.finish, batch_id, expected, final, now, output, error,
                                unrun_failed, bulk=True)
