"""Registered LoRA adapters: the names a request's ``model`` may give besides the base model, each the directory
under the gateway's ``--lora-dir`` its workers load, and owned by one tenant or by none (global).

Names are one namespace for the whole deployment (an operator registers them: nobody learns from a refused name
what another tenant holds). Who may use a name is decided where requests are read (``visible_to``): a global
adapter is every tenant's, an owned one only its owner's. A tenant's adapters are unregistered when it is
suspended or deleted (tenancy/store.py). It shares the tenancy store's database and rules: every write is one
transaction; the calls block, so the gateway runs them in threads.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from tenancy.db_backend import Backend, Row
from tenancy.models import LoraAdapterRecord

# What a registered name may look like: vLLM's names are free text, but a name travels in logs, metrics labels and
# kvgatectl tables, so letters, digits and . _ - : / only (``org/adapter`` style included), 1-128 of them.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_COLUMNS = "name, path, tenant_id, created_at"


class AdapterExists(ValueError):
    """The name is registered already (an operator error: a 409)."""


def check_adapter_name(name: object) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ValueError(f"'lora_name' must be 1-128 letters, digits or . _ - : / starting with a letter or digit, "
                         f"got {name!r}")
    return name


def visible_to(record: LoraAdapterRecord, tenant_id: str) -> bool:
    """Whether a tenant may use the adapter: a global one, or its own."""
    return record.tenant_id is None or record.tenant_id == tenant_id


class AdapterStore:
    def __init__(self, backend: Backend, *, clock: Callable[[], float] = time.time) -> None:
        self._db = backend
        self._clock = clock

    def add(self, name: str, path: str, tenant_id: str | None) -> LoraAdapterRecord:
        """Registers ``name``; AdapterExists when it is taken, KeyError when the owner does not exist."""
        record = LoraAdapterRecord(check_adapter_name(name), path, tenant_id, self._clock())
        with self._db.write() as tx:
            if tx.query("SELECT 1 FROM lora_adapters WHERE name = ?", (name,)):
                raise AdapterExists(f"LoRA adapter {name!r} is already registered")
            # Checked in the transaction that inserts: a tenant deleted meanwhile cannot be left owning a row.
            if tenant_id is not None and not tx.query("SELECT 1 FROM tenants WHERE id = ?", (tenant_id,)):
                raise KeyError(f"unknown tenant {tenant_id!r}")
            tx.execute(f"INSERT INTO lora_adapters ({_COLUMNS}) VALUES (?, ?, ?, ?)",
                       (record.name, record.path, record.tenant_id, record.created_at))
        return record

    def remove(self, name: str) -> LoraAdapterRecord | None:
        """Unregisters ``name``; the record it had, or None when nothing was registered under it."""
        with self._db.write() as tx:
            rows = tx.query(f"SELECT {_COLUMNS} FROM lora_adapters WHERE name = ?", (name,))
            if not rows:
                return None
            tx.execute("DELETE FROM lora_adapters WHERE name = ?", (name,))
        return _record(rows[0])

    def get(self, name: str) -> LoraAdapterRecord | None:
        rows = self._db.read(f"SELECT {_COLUMNS} FROM lora_adapters WHERE name = ?", (name,))
        return _record(rows[0]) if rows else None

    def list(self, tenant_id: str | None = None) -> list[LoraAdapterRecord]:
        """Every adapter, or those ``tenant_id`` owns (not the global ones), by name."""
        if tenant_id is None:
            rows = self._db.read(f"SELECT {_COLUMNS} FROM lora_adapters ORDER BY name")
        else:
            rows = self._db.read(f"SELECT {_COLUMNS} FROM lora_adapters WHERE tenant_id = ? ORDER BY name",
                                 (tenant_id,))
        return [_record(r) for r in rows]


def _record(row: Row) -> LoraAdapterRecord:
    return LoraAdapterRecord(str(row[0]), str(row[1]), None if row[2] is None else str(row[2]), float(row[3]))
