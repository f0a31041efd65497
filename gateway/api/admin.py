"""The ``/admin`` JSON API: tenants, keys, quotas and usage over the tenancy store, for ``kvgatectl --url``.

Every route needs ``Authorization: Bearer <admin token>`` (compared in constant time); tenant API keys never
work here. Without an admin token the API is disabled (403). The JSON shapes are ``tenancy.admin_ops``'s, so
the API and ``kvgatectl --db`` answer alike. Store calls block on SQLite's fsync, so they run in a thread;
``on_change`` runs after every successful mutation (the gateway drops its auth/quota cache then).

    GET    /admin/tenants                       -> {"object": "list", "data": [tenant]}
    POST   /admin/tenants {name, weight?, tier?} -> tenant (201)
    GET    /admin/tenants/<ref>                 -> tenant + {"keys": [key], "quota": quota}
    PATCH  /admin/tenants/<ref> {weight} | {log_text: bool} | {tier} -> tenant (one field per request)
    GET    /admin/tiers                         -> {"object": "list", "data": [{name, priority, capacity_share, ...}]}
    DELETE /admin/tenants/<ref>                 -> {"id", "name", "deleted": true}
    POST   /admin/tenants/<ref>/suspend|resume  -> tenant
    GET    /admin/tenants/<ref>/keys            -> {"object": "list", "data": [key]}
    POST   /admin/tenants/<ref>/keys {label?, expires_at? | expires_in_days?} -> key + {"key": plaintext} (201)
    GET    /admin/keys[?tenant=]                -> {"object": "list", "data": [key]}
    POST   /admin/keys/<key_id>/revoke          -> key + {"was_active": bool}
    GET    /admin/tenants/<ref>/quota[?key_id=] -> {"tenant_id", "tenant", "key_id", "scope", "row", "effective"}
    PUT    /admin/tenants/<ref>/quota[?key_id=] {field: value | null, ...} -> the same (merged into the row)
    GET    /admin/usage[?tenant=&since=&by=day|model|key|adapter] -> {"object": "list", "tenant_id", "since", "by", "data"}
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable, Mapping
from typing import Any

import trio
from quart import Blueprint, Response, request

from gateway.api.http_json import json_response, read_json
from gateway.base.errors import APIError, bad_request
from tenancy.admin_ops import AdminOpError, Json, LocalAdmin
from tenancy.admin_values import QUOTA_FIELDS
from tenancy.lora_check import LoraContext
from tenancy.store import TenancyStore
from tenancy.tiers import DEFAULT_TIER

ADMIN_TOKEN_ENV = "KVGATE_ADMIN_TOKEN"
TENANT_FIELDS = ("weight", "log_text", "tier")  # what PATCH /admin/tenants/<ref> may change


def op_error(e: AdminOpError) -> APIError:
    """An admin operation's refusal (unknown tenant, bad value) as the OpenAI-shaped error it answers."""
    return APIError(e.status, e.message, code=e.code, param=e.param)


def authorize_admin(admin_token: str | None) -> None:
    if not admin_token:
        raise APIError(403, f"the admin API is disabled: start the gateway with --admin-token or "
                            f"{ADMIN_TOKEN_ENV}", code="admin_disabled")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_token.encode()):
        raise APIError(401, "Incorrect admin token provided.", code="invalid_admin_token")


async def _body(allowed: tuple[str, ...]) -> dict[str, Any]:
    """The JSON object body ({} when empty), with only `allowed` fields."""
    body = await read_json(allow_empty=True)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    _only(body, allowed, "field")
    return body


def _only(given: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(k for k in given if k not in allowed)
    if unknown:
        known = ", ".join(allowed) or "none"
        raise bad_request(f"unknown {what}(s) {', '.join(unknown)}; known: {known}", param=unknown[0])


def _query(allowed: tuple[str, ...]) -> dict[str, str]:
    _only(request.args, allowed, "query parameter")
    return {k: request.args[k] for k in allowed if k in request.args}


class _AdminRoutes:
    """The admin handlers over one store: each a small method, bound into the blueprint by ``ROUTES``."""

    def __init__(self, ops: LocalAdmin, admin_token: str | None, on_change: Callable[[], None]) -> None:
        self.ops = ops
        self.admin_token = admin_token
        self.on_change = on_change

    async def require_admin_token(self) -> None:
        authorize_admin(self.admin_token)

    async def call(self, fn: Callable[..., Json], *args: Any, mutation: bool = False, status: int = 200) -> Response:
        try:
            result = await trio.to_thread.run_sync(functools.partial(fn, *args))
        except AdminOpError as e:
            raise op_error(e) from None
        if mutation:
            self.on_change()
        return json_response(result, status)

    async def list_tenants(self) -> Response:
        return await self.call(self.ops.list_tenants)

    async def create_tenant(self) -> Response:
        body = await _body(("name", "weight", "tier"))
        return await self.call(self.ops.create_tenant, body.get("name"), body.get("weight", 1.0),
                               body.get("tier", DEFAULT_TIER), mutation=True, status=201)

    async def show_tenant(self, ref: str) -> Response:
        return await self.call(self.ops.show_tenant, ref)

    async def update_tenant(self, ref: str) -> Response:
        body = await _body(TENANT_FIELDS)
        if len(body) != 1:
            # One field, one store write: a request that sets two could half-apply if the second is refused.
            raise bad_request("give exactly one of 'weight', 'log_text' or 'tier'", param=None if body else "weight")
        if "log_text" in body:
            return await self.call(self.ops.set_log_text, ref, body["log_text"], mutation=True)
        if "tier" in body:
            return await self.call(self.ops.set_tier, ref, body["tier"], mutation=True)
        return await self.call(self.ops.update_tenant, ref, body["weight"], mutation=True)

    async def tiers(self) -> Response:
        return await self.call(self.ops.tiers)

    async def delete_tenant(self, ref: str) -> Response:
        return await self.call(self.ops.delete_tenant, ref, mutation=True)

    async def suspend_tenant(self, ref: str) -> Response:
        await _body(())
        return await self.call(self.ops.suspend_tenant, ref, mutation=True)

    async def resume_tenant(self, ref: str) -> Response:
        await _body(())
        return await self.call(self.ops.resume_tenant, ref, mutation=True)

    async def list_tenant_keys(self, ref: str) -> Response:
        return await self.call(self.ops.list_keys, ref)

    async def create_key(self, ref: str) -> Response:
        body = await _body(("label", "expires_at", "expires_in_days"))
        return await self.call(self.ops.create_key, ref, body.get("label", ""), body.get("expires_at"),
                               body.get("expires_in_days"), mutation=True, status=201)

    async def list_keys(self) -> Response:
        return await self.call(self.ops.list_keys, _query(("tenant",)).get("tenant"))

    async def revoke_key(self, key_id: str) -> Response:
        await _body(())
        return await self.call(self.ops.revoke_key, key_id, mutation=True)

    async def get_quota(self, ref: str) -> Response:
        return await self.call(self.ops.get_quota, ref, _query(("key_id",)).get("key_id"))

    async def update_quota(self, ref: str) -> Response:
        key_id = _query(("key_id",)).get("key_id")
        body = await _body(QUOTA_FIELDS)
        return await self.call(self.ops.update_quota, ref, body, key_id, mutation=True)

    async def usage(self) -> Response:
        q = _query(("tenant", "since", "by"))
        return await self.call(self.ops.usage, q.get("tenant"), q.get("since"), q.get("by"))


# (method, rule under /admin, handler name): the table the module docstring describes.
ROUTES = (
    ("GET", "/tenants", "list_tenants"),
    ("POST", "/tenants", "create_tenant"),
    ("GET", "/tenants/<ref>", "show_tenant"),
    ("PATCH", "/tenants/<ref>", "update_tenant"),
    ("DELETE", "/tenants/<ref>", "delete_tenant"),
    ("POST", "/tenants/<ref>/suspend", "suspend_tenant"),
    ("POST", "/tenants/<ref>/resume", "resume_tenant"),
    ("GET", "/tenants/<ref>/keys", "list_tenant_keys"),
    ("POST", "/tenants/<ref>/keys", "create_key"),
    ("GET", "/keys", "list_keys"),
    ("POST", "/keys/<key_id>/revoke", "revoke_key"),
    ("GET", "/tenants/<ref>/quota", "get_quota"),
    ("PUT", "/tenants/<ref>/quota", "update_quota"),
    ("GET", "/usage", "usage"),
    ("GET", "/tiers", "tiers"),
)


def create_admin_blueprint(store: TenancyStore, admin_token: str | None, on_change: Callable[[], None],
                           lora: LoraContext | None = None) -> Blueprint:
    """``lora``: the gateway's --lora-dir, so that suspending or deleting a tenant also removes its uploaded
    adapters' files (tenancy/adapter_files.py)."""
    bp = Blueprint("admin", __name__, url_prefix="/admin")
    routes = _AdminRoutes(LocalAdmin(store, lora=lora), admin_token, on_change)
    bp.before_request(routes.require_admin_token)
    for method, rule, name in ROUTES:
        bp.add_url_rule(rule, name, getattr(routes, name), methods=[method])
    return bp
