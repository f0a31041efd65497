"""Registering LoRA adapters, an operator's job (the admin token, never a tenant key), at vLLM's paths and in
vLLM's request shapes, plus the list ``kvgatectl adapters list`` reads:

    POST /v1/load_lora_adapter   {lora_name, lora_path, tenant?} -> the adapter + {rank, target_modules}
    POST /v1/unload_lora_adapter {lora_name, lora_int_id?}       -> the adapter + {"deleted": true}
    GET  /admin/adapters[?tenant=]                               -> {"object": "list", "data": [adapter]}

``lora_path`` is a directory directly inside the gateway's ``--lora-dir`` (relative to it, or absolute); ``tenant``
(kvgate's, optional) makes the adapter that tenant's alone. The adapter is checked against the base model before
it is registered (tenancy/lora_check.py), so no worker ever sees one that was refused; a refusal is a 4xx and
registers nothing. Workers load an adapter when a request first names it (workers/lora/registry.py); unregistering
stops new requests at once (this gateway) or within a second (others), and the workers' LRU lets it go. Tenants
upload their own adapters at ``/v1/adapters`` (gateway/api/adapter_upload.py, on this blueprint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio
from quart import Blueprint, Response, request

from gateway.api.adapter_upload import add_upload_routes
from gateway.api.admin import authorize_admin, op_error
from gateway.api.context import app_state
from gateway.api.http_json import json_response, read_json
from gateway.base.errors import bad_request
from tenancy.admin_ops import AdminOpError, Json, LocalAdmin

LOAD_FIELDS = ("lora_name", "lora_path", "tenant")
UNLOAD_FIELDS = ("lora_name", "lora_int_id")  # vLLM's; kvgate names adapters only, so lora_int_id is not read


async def _body(allowed: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    body = await read_json()
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(allowed)}", param=unknown[0])
    for name in required:
        if name not in body:
            raise bad_request(f"'{name}' is required", param=name)
    return body


async def _call(fn: Callable[..., Json], *args: Any, mutation: bool = False) -> Response:
    state = app_state()
    try:
        result = await trio.to_thread.run_sync(functools.partial(fn, *args))
    except AdminOpError as e:
        raise op_error(e) from None
    if mutation:
        state.tenancy.adapters.invalidate()  # this gateway's requests see the change at once
    return json_response(result)


def _ops() -> LocalAdmin:
    state = app_state()
    return LocalAdmin(state.tenancy.store, lora=state.lora)


async def load_lora_adapter() -> Response:
    authorize_admin(app_state().config.tenancy.admin_token)  # before the body: no parsing for strangers
    body = await _body(LOAD_FIELDS, ("lora_name", "lora_path"))
    return await _call(_ops().load_adapter, body["lora_name"], body["lora_path"], body.get("tenant"), mutation=True)


async def unload_lora_adapter() -> Response:
    authorize_admin(app_state().config.tenancy.admin_token)
    body = await _body(UNLOAD_FIELDS, ("lora_name",))
    return await _call(_ops().unload_adapter, body["lora_name"], mutation=True)


async def list_adapters() -> Response:
    authorize_admin(app_state().config.tenancy.admin_token)
    unknown = sorted(set(request.args) - {"tenant"})
    if unknown:
        raise bad_request(f"unknown query parameter(s) {', '.join(unknown)}", param=unknown[0])
    return await _call(_ops().list_adapters, request.args.get("tenant"))


def create_adapter_blueprint() -> Blueprint:
    bp = Blueprint("lora_adapters", __name__)
    bp.add_url_rule("/v1/load_lora_adapter", "load_lora_adapter", load_lora_adapter, methods=["POST"])
    bp.add_url_rule("/v1/unload_lora_adapter", "unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    bp.add_url_rule("/admin/adapters", "list_adapters", list_adapters, methods=["GET"])
    add_upload_routes(bp)  # tenants' own uploads, with their API keys: /v1/adapters (gateway/api/adapter_upload.py)
    return bp
