"""Admin operations over a TenancyStore, answered as JSON-ready dicts: the one source of the admin JSON shapes.

The gateway's ``/admin`` API (gateway/api/admin.py) and ``kvgatectl --db`` both call ``LocalAdmin``; ``kvgatectl
--url`` (console/admin_client.py) calls the API, which answers with the same dicts, so ``--json`` output is the
same either way. Both backends implement ``AdminBackend``. Every operation validates its input, whatever its
type (values may come straight from a JSON body), and raises ``AdminOpError`` for anything wrong: bad input is a
400, an unknown tenant or key a 404, a duplicate name a 409. Plaintext keys appear once, in ``create_key``'s
answer; listings show a key's id, label and display prefix only.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, Protocol, TypeVar

from tenancy.adapter_ops import AdapterAdmin, AdapterOpError
from tenancy.admin_values import (AdminInputError, check_expiry, check_flag, check_label, check_name,
                                  check_quota_patch, check_ref, check_tier, check_weight, parse_grouping, parse_since)
from tenancy.lora_check import LoraContext
from tenancy.models import ApiKeyInfo, Quota, Tenant, UsageGroup
from tenancy.store import TenancyStore
from tenancy.tiers import DEFAULT_TIER, TIERS, Tier

Json = dict[str, Any]
P = ParamSpec("P")
R = TypeVar("R")


class AdminOpError(Exception):
    """A failed admin operation: an HTTP-like status (0: no answer from a remote gateway), a code, a message."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


class AdminBackend(Protocol):
    """What kvgatectl drives: a store on this host (LocalAdmin) or a gateway's admin API (RemoteAdmin)."""

    def list_tenants(self) -> Json: ...
    def create_tenant(self, name: str, weight: float = 1.0, tier: str = DEFAULT_TIER) -> Json: ...
    def show_tenant(self, ref: str) -> Json: ...
    def suspend_tenant(self, ref: str) -> Json: ...
    def resume_tenant(self, ref: str) -> Json: ...
    def update_tenant(self, ref: str, weight: float) -> Json: ...
    def set_log_text(self, ref: str, on: bool) -> Json: ...
    def set_tier(self, ref: str, tier: str) -> Json: ...
    def tiers(self) -> Json: ...
    def delete_tenant(self, ref: str) -> Json: ...
    def create_key(self, tenant: str, label: str = "", expires_at: float | None = None,
                   expires_in_days: float | None = None) -> Json: ...
    def list_keys(self, tenant: str | None = None) -> Json: ...
    def revoke_key(self, key_id: str) -> Json: ...
    def get_quota(self, tenant: str, key_id: str | None = None) -> Json: ...
    def update_quota(self, tenant: str, patch: Mapping[str, Any], key_id: str | None = None) -> Json: ...
    def usage(self, tenant: str | None = None, since: str | None = None, by: str | None = None) -> Json: ...
    def list_adapters(self, tenant: str | None = None) -> Json: ...
    def load_adapter(self, name: str, path: str, tenant: str | None = None) -> Json: ...
    def unload_adapter(self, name: str) -> Json: ...


# --- JSON shapes -------------------------------------------------------------------------------------------

def list_json(items: list[Json], **extra: Any) -> Json:
    return {"object": "list", **extra, "data": items}


def tenant_json(t: Tenant) -> Json:
    return {"id": t.id, "name": t.name, "status": t.status, "weight": t.weight, "created_at": t.created_at,
            "log_text": t.log_text, "tier": t.tier}


def tier_json(t: Tier) -> Json:
    return {"name": t.name, "priority": t.priority, "capacity_share": t.capacity_share,
            "description": t.description}


def tiers_json() -> Json:
    """The tier table (best first); the same on every gateway of one kvgate version."""
    return list_json([tier_json(t) for t in TIERS])


def key_status(k: ApiKeyInfo, now: float) -> str:
    if k.revoked_at is not None:
        return "revoked"
    return "expired" if k.expires_at is not None and now >= k.expires_at else "active"


def key_json(k: ApiKeyInfo, now: float) -> Json:
    return {"id": k.id, "tenant_id": k.tenant_id, "label": k.label, "key_prefix": k.key_prefix,
            "status": key_status(k, now), "created_at": k.created_at, "expires_at": k.expires_at,
            "revoked_at": k.revoked_at}


def quota_json(q: Quota) -> Json:
    out = dataclasses.asdict(q)
    out["allowed_models"] = None if q.allowed_models is None else list(q.allowed_models)
    return out


def usage_json(g: UsageGroup) -> Json:
    return {"group": g.group, "requests": g.requests, "prompt_tokens": g.prompt_tokens,
            "cached_tokens": g.cached_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.total_tokens}


# --- the local backend -------------------------------------------------------------------------------------

def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    """The store's KeyError (unknown tenant/key, e.g. deleted meanwhile) -> 404, ValueError -> 400."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except AdminInputError as e:
            raise AdminOpError(400, str(e), code="invalid_request", param=e.param) from None
        except KeyError as e:
            raise AdminOpError(404, str(e.args[0]) if e.args else "not found", code="not_found") from None
        except ValueError as e:
            raise AdminOpError(400, str(e), code="invalid_request") from None
    return wrapper


class LocalAdmin:
    """AdminBackend over a TenancyStore in this process. Blocking (SQLite): async callers use a thread."""

    def __init__(self, store: TenancyStore, clock: Callable[[], float] = time.time,
                 lora: LoraContext | None = None) -> None:
        self._store = store
        self._clock = clock
        self._adapters = AdapterAdmin(store, lora)  # lora None: adapters can be listed and removed, not added

    def _tenant(self, ref: object, param: str = "tenant") -> Tenant:
        tenant = self._store.find_tenant(check_ref(ref, param))
        if tenant is None:
            raise AdminOpError(404, f"unknown tenant {ref!r}", code="tenant_not_found", param=param)
        return tenant

    def _key(self, key_id: object, tenant: Tenant | None = None) -> ApiKeyInfo:
        key = self._store.find_key(check_ref(key_id, "key_id"))
        if key is None or (tenant is not None and key.tenant_id != tenant.id):
            owner = f" of tenant {tenant.name!r}" if tenant is not None else ""
            raise AdminOpError(404, f"unknown key {key_id!r}{owner}", code="key_not_found", param="key_id")
        return key

    # tenants

    @_translated
    def list_tenants(self) -> Json:
        return list_json([tenant_json(t) for t in self._store.list_tenants()])

    @_translated
    def create_tenant(self, name: str, weight: float = 1.0, tier: str = DEFAULT_TIER) -> Json:
        name = check_name(name)
        weight = check_weight(weight)
        tier = check_tier(tier)
        if self._store.find_tenant(name) is not None:
            raise AdminOpError(409, f"tenant {name!r} already exists", code="tenant_exists", param="name")
        return tenant_json(self._store.create_tenant(name, weight, tier))

    @_translated
    def show_tenant(self, ref: str) -> Json:
        tenant = self._tenant(ref)
        now = self._clock()
        keys = [key_json(k, now) for k in self._store.list_keys(tenant.id)]
        quota = quota_json(self._store.quota_rows(tenant.id)[0])
        return {**tenant_json(tenant), "keys": keys, "quota": quota}

    @_translated
    def suspend_tenant(self, ref: str) -> Json:
        tenant = self._tenant(ref)
        out = tenant_json(self._store.suspend_tenant(tenant.id))
        self._adapters.sweep(tenant.id)  # its adapters were unregistered with it: their uploaded files go too
        return out

    @_translated
    def resume_tenant(self, ref: str) -> Json:
        return tenant_json(self._store.resume_tenant(self._tenant(ref).id))

    @_translated
    def update_tenant(self, ref: str, weight: float) -> Json:
        weight = check_weight(weight)
        return tenant_json(self._store.set_weight(self._tenant(ref).id, weight))

    @_translated
    def set_log_text(self, ref: str, on: bool) -> Json:
        on = check_flag(on, "log_text")
        return tenant_json(self._store.set_log_text(self._tenant(ref).id, on))

    @_translated
    def set_tier(self, ref: str, tier: str) -> Json:
        tier = check_tier(tier)
        return tenant_json(self._store.set_tier(self._tenant(ref).id, tier))

    def tiers(self) -> Json:
        return tiers_json()

    @_translated
    def delete_tenant(self, ref: str) -> Json:
        tenant = self._tenant(ref)
        self._store.delete_tenant(tenant.id)
        self._adapters.sweep(tenant.id)
        return {"id": tenant.id, "name": tenant.name, "deleted": True}

    # keys

    @_translated
    def create_key(self, tenant: str, label: str = "", expires_at: float | None = None,
                   expires_in_days: float | None = None) -> Json:
        owner = self._tenant(tenant)
        label = check_label(label)
        now = self._clock()
        expiry = check_expiry(expires_at, expires_in_days, now)
        key_id, plaintext = self._store.create_key(owner.id, label, expiry)
        return {**key_json(self._key(key_id), now), "key": plaintext}

    @_translated
    def list_keys(self, tenant: str | None = None) -> Json:
        tenant_id = None if tenant is None else self._tenant(tenant).id
        now = self._clock()
        return list_json([key_json(k, now) for k in self._store.list_keys(tenant_id)])

    @_translated
    def revoke_key(self, key_id: str) -> Json:
        key = self._key(key_id)
        changed = self._store.revoke_key(key.id)
        return {**key_json(self._key(key.id), self._clock()), "was_active": changed}

    # quotas

    @_translated
    def get_quota(self, tenant: str, key_id: str | None = None) -> Json:
        owner = self._tenant(tenant)
        if key_id is not None:
            key_id = self._key(key_id, owner).id
        tenant_row, key_row = self._store.quota_rows(owner.id, key_id)
        if key_id is None:
            row, effective = tenant_row, tenant_row
        else:
            row = key_row or Quota()
            effective = tenant_row.overridden_by(row)
        return {"tenant_id": owner.id, "tenant": owner.name, "key_id": key_id,
                "scope": "tenant" if key_id is None else "key", "row": quota_json(row),
                "effective": quota_json(effective)}

    @_translated
    def update_quota(self, tenant: str, patch: Mapping[str, Any], key_id: str | None = None) -> Json:
        """Merges `patch` into the scope's row: given fields replace, null clears (unlimited / inherit)."""
        owner = self._tenant(tenant)
        if key_id is not None:
            key_id = self._key(key_id, owner).id
        changes = check_quota_patch(patch)
        tenant_row, key_row = self._store.quota_rows(owner.id, key_id)
        current = tenant_row if key_id is None else (key_row or Quota())
        self._store.set_quota(owner.id, dataclasses.replace(current, **changes), key_id)
        return self.get_quota(owner.id, key_id)

    # usage

    @_translated
    def usage(self, tenant: str | None = None, since: str | None = None, by: str | None = None) -> Json:
        tenant_id = None if tenant is None else self._tenant(tenant).id
        start = parse_since(since, self._clock())
        grouping = parse_grouping(by)
        groups = self._store.usage_summary(tenant_id, start, grouping)
        return list_json([usage_json(g) for g in groups], tenant_id=tenant_id, since=start, by=grouping)

    # LoRA adapters (tenancy/adapter_ops.py)

    def list_adapters(self, tenant: str | None = None) -> Json:
        return _adapter_op(lambda: self._adapters.list(tenant))

    def load_adapter(self, name: str, path: str, tenant: str | None = None) -> Json:
        return _adapter_op(lambda: self._adapters.load(name, path, tenant))

    def unload_adapter(self, name: str) -> Json:
        return _adapter_op(lambda: self._adapters.unload(name))


def _adapter_op(op: Callable[[], Json]) -> Json:
    try:
        return op()
    except AdapterOpError as e:
        raise AdminOpError(e.status, e.message, code=e.code, param=e.param) from None
