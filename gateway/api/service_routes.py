"""The small OpenAI-side and operational routes: health, readiness, version, the model list, a tenant's own
usage and the Prometheus ``/metrics`` text."""

from __future__ import annotations

from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from gateway.api.admin import op_error
from gateway.api.context import app_state, authorize
from gateway.api.http_json import json_response
from gateway.api.openapi import VERSION
from gateway.base.errors import DRAIN_RETRY_AFTER_S, APIError, bad_request, model_not_found
from gateway.base.principal import Principal
from gateway.telemetry import metrics
from common.engine_flags import FLAGS_BY_DEST
from tenancy.admin_ops import AdminOpError, LocalAdmin


def register(app: QuartTrio) -> None:
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    app.add_url_rule("/ready", view_func=ready, methods=["GET"])
    app.add_url_rule("/version", view_func=version, methods=["GET"])
    app.add_url_rule("/v1/models", view_func=models, methods=["GET"])
    app.add_url_rule("/v1/models/<path:model>", view_func=model, methods=["GET"])
    app.add_url_rule("/v1/usage", view_func=own_usage, methods=["GET"])
    app.add_url_rule("/metrics", view_func=prometheus, methods=["GET"])


DEFAULT_MAX_LORAS = int(FLAGS_BY_DEST["max_loras"].default)  # what workers run with when serve was not given it


async def health() -> Response:
    return json_response({"status": "ok"})


async def ready() -> Response:
    state = app_state()
    pool = state.pool
    if state.draining:  # load balancers take this gateway out of rotation while its streams finish
        raise APIError(503, "the gateway is draining", code="draining", retry_after=DRAIN_RETRY_AFTER_S)
    if not pool.ready:
        raise APIError(503, "no worker is ready", code="not_ready", retry_after=pool.retry_after())
    return json_response({"status": "ready", "workers": sorted(pool.workers)})


async def version() -> Response:
    return json_response({"version": VERSION})


async def models() -> Response:
    """The base model and the LoRA adapters this caller may use (global and its tenant's), each adapter with
    ``parent`` = the base model's id, as vLLM lists them."""
    principal = await authorize()
    return json_response({"object": "list", "data": await _model_entries(principal)})


async def model(model: str) -> Response:
    """OpenAI's retrieve-model: one entry of the caller's ``/v1/models``; anything else (another tenant's adapter
    too) is the 404 a name nobody registered gets."""
    principal = await authorize()
    entry = next((e for e in await _model_entries(principal) if e["id"] == model), None)
    if entry is None:
        raise model_not_found(model)
    return json_response(entry)


async def _model_entries(principal: Principal) -> list[dict[str, Any]]:
    state = app_state()
    cfg = state.config
    max_len = state.pool.max_model_len
    entries = [{"id": cfg.model_name, "object": "model", "created": state.created, "owned_by": "kvgate",
                "root": cfg.model, "parent": None, "max_model_len": max_len}]
    for a in await state.tenancy.adapters.visible(principal.tenant_id):
        # root: vLLM gives the adapter's path; a tenant is not shown the server's directories
        entries.append({"id": a.name, "object": "model", "created": int(a.created_at),
                        "owned_by": "kvgate" if a.tenant_id is None else principal.tenant_name,
                        "root": a.name, "parent": cfg.model_name, "max_model_len": max_len})
    return [e for e in entries if principal.allows_model(str(e["id"]))]


async def own_usage() -> Response:
    """The calling tenant's own usage (never another's): the admin API's shape for one tenant, with
    ``since`` (unix seconds, ISO date/time or 7d/24h) and ``by`` (day, model, key, adapter)."""
    principal = await authorize()
    unknown = sorted(set(request.args) - {"since", "by"})
    if unknown:
        raise bad_request(f"unknown query parameter(s) {', '.join(unknown)}", param=unknown[0])
    admin_ops = LocalAdmin(app_state().tenancy.store)
    try:
        body = await trio.to_thread.run_sync(admin_ops.usage, principal.tenant_id, request.args.get("since"),
                                             request.args.get("by"))
    except AdminOpError as e:
        raise op_error(e) from None
    return json_response({**body, "tenant": principal.tenant_name})


async def prometheus() -> Response:
    state = app_state()
    cfg, ten, gm = state.config, state.tenancy, state.metrics
    text = metrics.render(state.pool, cfg.model_name, cfg.observability.gpu_hour_cost, gm.billed_tokens)
    text += metrics.queues(ten.ledger.queued, ten.quota.queued)
    if ten.adapters.enabled:
        text += metrics.lora_requests_info(state.pool, int(cfg.engine.values.get("max_loras", DEFAULT_MAX_LORAS)))
    return Response(text + gm.render(), content_type=metrics.CONTENT_TYPE)
