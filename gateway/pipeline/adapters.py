"""Which LoRA adapter a request's ``model`` names, for its tenant: the registry (``tenancy.adapters_store``) as this
gateway sees it, read whole at most once a ``ttl`` (a second), so an adapter registered or removed anywhere (this
gateway's admin API, another gateway, ``kvgatectl --db``) applies within it; this gateway's own changes drop the
snapshot at once.

A name is an adapter for a tenant when it is registered globally or to that tenant; any other name, whether it is
another tenant's adapter or nothing at all, resolves to None, so the caller answers both with the same 404 (no
oracle for what other tenants hold). The snapshot is the whole table, never per name: guessed names cannot grow it.
Without ``--lora-dir`` adapters are off and nothing is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from gateway.base.errors import store_unavailable
from tenancy.adapters_store import AdapterStore, visible_to
from tenancy.models import LoraAdapterRecord

log = logging.getLogger("kvgate.gateway.adapters")

STORE_TIMEOUT_S = 10.0  # as the other store calls: a hung database is a 503, never a stalled request


class AdapterCatalog:
    def __init__(self, store: AdapterStore | None, *, ttl: float = 1.0, timeout_s: float = STORE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store  # None: adapters are off (no --lora-dir)
        self._ttl = ttl
        self._timeout_s = timeout_s
        self._clock = clock
        self._snapshot: dict[str, LoraAdapterRecord] = {}
        self._expires = -float("inf")
        # Bumped by invalidate(): a read that was already under way when a write committed may hold the old table,
        # so it is served to its own waiters but not kept (the next request reads again).
        self._generation = 0
        self._lock = trio.Lock()  # one read of the table at a time, however many requests wait for it

    @property
    def enabled(self) -> bool:
        return self._store is not None

    def invalidate(self) -> None:
        self._generation += 1
        self._expires = -float("inf")

    async def _all(self) -> dict[str, LoraAdapterRecord]:
        if self._store is None:
            return {}
        try:
            # The deadline covers the wait for the lock too: behind a hung read, every request gives up in time.
            with trio.fail_after(self._timeout_s):
                async with self._lock:
                    if self._clock() >= self._expires:
                        generation = self._generation
                        records = await trio.to_thread.run_sync(self._store.list, abandon_on_cancel=True)
                        snapshot = {r.name: r for r in records}
                        if generation != self._generation:  # a write committed during the read: maybe not in it
                            return snapshot
                        self._snapshot = snapshot
                        self._expires = self._clock() + self._ttl
                    return self._snapshot
        except trio.TooSlowError:
            log.error("adapter registry: no answer within %.0fs", self._timeout_s)
            raise store_unavailable("the adapter registry is unavailable; retry the request") from None
        except Exception as e:  # noqa: BLE001 - whatever the database raised: a 503, the log says which
            log.error("adapter registry: read failed (%s)", type(e).__name__)
            raise store_unavailable("the adapter registry is unavailable; retry the request") from None

    async def resolve(self, name: str, tenant_id: str) -> LoraAdapterRecord | None:
        """The adapter ``name`` names for this tenant, or None (not registered, or not the tenant's)."""
        record = (await self._all()).get(name)
        return record if record is not None and visible_to(record, tenant_id) else None

    async def visible(self, tenant_id: str) -> list[LoraAdapterRecord]:
        """The adapters this tenant may use (global and its own), by name."""
        return sorted((r for r in (await self._all()).values() if visible_to(r, tenant_id)), key=lambda r: r.name)
