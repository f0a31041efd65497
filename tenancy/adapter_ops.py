"""The admin operations on LoRA adapters (register, unregister, list), answered as JSON-ready dicts; the gateway's
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` and ``/admin/adapters`` and ``kvgatectl adapters`` share
them (``LocalAdmin`` delegates here).

Registering needs a ``LoraContext`` (the adapter directory and the base model's shapes): the gateway has one from
its ``--lora-dir`` and model; ``kvgatectl --db`` has none, so it registers through a gateway (``--url``). Every
check runs before the store is touched: a refused adapter leaves nothing registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tenancy.adapter_files import sweep_uploads
from tenancy.adapters_store import NAME_RE, AdapterExists, AdapterStore, check_adapter_name
from tenancy.lora_check import LoraContext, check_adapter, resolve_adapter_dir
from tenancy.models import LoraAdapterRecord, Tenant
from tenancy.store import TenancyStore

Json = dict[str, Any]


class AdapterOpError(Exception):
    """Mirrors tenancy.admin_ops.AdminOpError (which wraps it): a status, a code, a message, a param."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def adapter_json(a: LoraAdapterRecord, owner: Tenant | None) -> Json:
    return {"object": "lora_adapter", "name": a.name, "path": a.path, "tenant_id": a.tenant_id,
            "tenant": None if owner is None else owner.name, "created_at": a.created_at}


class AdapterAdmin:
    def __init__(self, store: TenancyStore, lora: LoraContext | None) -> None:
        self._store = store
        self._adapters = AdapterStore(store.backend)
        self._lora = lora

    def _owner(self, ref: object) -> Tenant | None:
        if ref is None:
            return None
        if not isinstance(ref, str) or not ref:
            raise AdapterOpError(400, f"'tenant' must be a tenant name or id, got {ref!r}", code="invalid_request",
                                 param="tenant")
        # A NUL byte is a PostgreSQL error, not a lookup: such a ref names no tenant (a 404, never a 500)
        tenant = None if "\x00" in ref else self._store.find_tenant(ref)
        if tenant is None:
            raise AdapterOpError(404, f"unknown tenant {ref!r}", code="tenant_not_found", param="tenant")
        return tenant

    def _json(self, a: LoraAdapterRecord) -> Json:
        owner = None if a.tenant_id is None else self._store.find_tenant(a.tenant_id)
        return adapter_json(a, owner)

    def load(self, name: object, path: object, tenant: object = None) -> Json:
        """Check and register; 400 for a bad name, path or adapter, 404 for an unknown owner, 409 for a taken
        name. The answer adds the adapter's rank and targets."""
        if self._lora is None:
            raise AdapterOpError(400, "LoRA adapters are off: start the gateway with --lora-dir (kvgatectl "
                                      "registers through a gateway: --url)", code="lora_disabled")
        try:
            name = check_adapter_name(name)
        except ValueError as e:
            raise AdapterOpError(400, str(e), code="invalid_request", param="lora_name") from None
        owner = self._owner(tenant)
        try:
            directory = resolve_adapter_dir(self._lora.directory, path)
            summary = check_adapter(self._lora.directory / directory, self._lora.base)
        except ValueError as e:
            raise AdapterOpError(400, f"LoRA adapter {name!r}: {e}", code="invalid_lora_adapter",
                                 param="lora_path") from None
        try:
            record = self._adapters.add(name, directory, None if owner is None else owner.id)
        except AdapterExists as e:
            raise AdapterOpError(409, str(e), code="adapter_exists", param="lora_name") from None
        except KeyError:  # the owner was deleted between the check and the insert
            raise AdapterOpError(404, f"unknown tenant {tenant!r}", code="tenant_not_found", param="tenant") from None
        return {**adapter_json(record, owner), "rank": summary.rank, "target_modules": list(summary.targets)}

    def unload(self, name: object) -> Json:
        if not isinstance(name, str) or not name:
            raise AdapterOpError(400, f"'lora_name' must be a non-empty string, got {name!r}",
                                 code="invalid_request", param="lora_name")
        # A name that cannot be registered is not looked up (a NUL byte would be a PostgreSQL error, not a 404)
        record = self._adapters.remove(name) if NAME_RE.fullmatch(name) else None
        if record is None:
            raise AdapterOpError(404, f"LoRA adapter {name!r} is not registered", code="adapter_not_found",
                                 param="lora_name")
        return {**self._json(record), "deleted": True}

    def list(self, tenant: object = None) -> Json:
        owner = self._owner(tenant)
        records = self._adapters.list(None if owner is None else owner.id)
        tenants = {t.id: t for t in self._store.list_tenants()}  # one query for the owners, not one per row
        return {"object": "list", "data": [adapter_json(a, tenants.get(a.tenant_id or "")) for a in records]}

    def sweep(self, tenant_id: str | None = None) -> Sequence[str]:  # (``list`` is a method here)
        """Removes tenants' uploads nothing is registered over (tenancy/adapter_files.py); [] without --lora-dir."""
        if self._lora is None:
            return []
        return sweep_uploads(self._lora.directory, {a.path for a in self._adapters.list()}, tenant_id=tenant_id)
