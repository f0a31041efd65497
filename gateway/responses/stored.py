"""The gateway's side of stored responses (``tenancy.responses_store``): every call in a worker thread under a
deadline, so the event loop never waits on the database; failures as OpenAI-shaped 503s; and the periodic prune of
expired rows, a task in the gateway's outer nursery (reads already ignore expired rows, so its period only bounds
how long they take up space).

A call past its deadline is abandoned rather than waited for (a hung database must not hold a request, or a
shutdown): its thread finishes on its own and the answer is dropped. An abandoned ``put`` may still land after its
client was told 503; that response is then retrievable but was never returned, which is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from gateway.base.errors import APIError, store_unavailable
from tenancy.responses_store import Part, ResponseStore, StoredResponse

log = logging.getLogger("kvgate.gateway.responses")
T = TypeVar("T")

STORE_TIMEOUT_S = 10.0  # the SQLite busy timeout: a write waiting longer than this is not coming
MAX_PRUNE_INTERVAL_S = 600.0


_UNAVAILABLE = "the response store is unavailable; retry the request"


# A put fails after the generation ran and was billed: say so, so the client does not take it for a refusal.
_NOT_STORED = ("the response was generated but could not be stored; retry, or send store: false to have it "
               "without storing it")


class StoredResponses:
    def __init__(self, store: ResponseStore, *, timeout_s: float = STORE_TIMEOUT_S) -> None:
        self._store = store
        self._timeout_s = timeout_s
        # A quarter of the retention: an expired row stays on disk at most that much longer.
        self.prune_interval_s = min(MAX_PRUNE_INTERVAL_S, max(1.0, store.retention_s / 4))
        self.pruned = 0  # rows this gateway deleted as expired (tests, logs)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, failure: str = _UNAVAILABLE) -> T:
        try:
            with trio.fail_after(self._timeout_s):
                return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except trio.TooSlowError:
            log.error("response store: %s took over %.0fs; abandoned", what, self._timeout_s)
            raise store_unavailable(failure) from None
        except Exception as e:  # noqa: BLE001 - whatever the database raised: the client gets a 503, the log why
            # The type and SQLSTATE only: a database's message may quote the values written (completion text).
            log.error("response store: %s failed (%s, sqlstate %s)", what, type(e).__name__,
                      getattr(e, "sqlstate", None))
            raise store_unavailable(failure) from None

    async def read(self, tenant_id: str, response_id: str, part: Part) -> Any | None:
        """One part of a live response of the tenant, or None (unknown, expired, deleted, another tenant's)."""
        return await self._call(f"read {part}", self._store.read, tenant_id, response_id, part)

    async def put(self, record: StoredResponse) -> None:
        await self._call("put", self._store.put, record, failure=_NOT_STORED)

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        return await self._call("delete", self._store.delete, tenant_id, response_id)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prune expired rows now and every ``prune_interval_s`` until cancelled. Several gateways on one database
        each prune: the deletes are idempotent."""
        task_status.started()
        while True:
            try:
                pruned = await self._call("prune", self._store.prune)
            except APIError:
                pass  # logged by _call; the next round tries again
            else:
                self.pruned += pruned
                if pruned:
                    log.info("pruned %d expired stored responses", pruned)
            await trio.sleep(self.prune_interval_s)
