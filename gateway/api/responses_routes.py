"""OpenAI's Responses API: ``POST /v1/responses`` (a JSON response or a typed event stream), ``GET`` and ``DELETE``
``/v1/responses/{id}``, and ``GET /v1/responses/{id}/input_items``.

A create runs as a chat completion (``gateway.responses``): auth, the model check, validation, the earlier turns
from the store when ``previous_response_id`` names one, the translated chat body through ``parse_chat``, then the
generation routes' own admission, submission and stream start (``gateway.api.generation_routes``), so quotas, the
ledger, tracing and disconnects behave exactly as on ``/v1/chat/completions``. A response with ``store`` (the
default) is stored after its ledger row and before its client sees it end. Stored responses belong to one tenant:
another tenant's id is a 404 exactly like an unknown one.
"""

from __future__ import annotations

import time
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio

from gateway.base.principal import Principal
from gateway.api.context import app_state, authorize, check_model
from gateway.base.errors import APIError, bad_request
from gateway.api.generation_routes import reserve, served_name, start_stream, submit, tokenize, traced
from gateway.api.http_json import json_response, read_json
from gateway.responses.items import ChatMessage, new_id
from gateway.responses.objects import ResponseDraft
from gateway.responses.request import ResponsesRequest, chat_body, parse_as_chat, parse_responses
from gateway.pipeline.streaming import run_to_end
from gateway.responses.run import ResponsesStream, Save
from gateway.telemetry.tracing import RequestTrace
from tenancy.responses_store import StoredResponse

MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20  # OpenAI's for input_items


def register(app: QuartTrio) -> None:
    app.add_url_rule("/v1/responses", view_func=create_response, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", view_func=retrieve_response, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", view_func=delete_response, methods=["DELETE"])
    app.add_url_rule("/v1/responses/<response_id>/input_items", view_func=list_input_items, methods=["GET"])


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="not_found")


async def create_response() -> Response:
    return await traced(run_create)


async def run_create(rt: RequestTrace) -> Response:
    state = app_state()
    cfg = state.config
    with rt.phase("auth"):
        principal = await authorize()
    with rt.phase("tokenize"):
        body = await read_json()
        adapter = await check_model(body, principal)
        rreq = parse_responses(body)
        history = await _history(principal, rreq.previous_response_id)
        req = await tokenize(parse_as_chat, chat_body(rreq, cfg.model_name, history), principal)
    response_id = new_id("resp")  # the worker's request id and the ledger's too
    g.request_id = response_id  # the x-request-id header
    await reserve(principal, req, response_id, rt)
    choices, account = await submit(principal, req, response_id, rt, adapter)
    draft = ResponseDraft(response_id, served_name(adapter), int(time.time()), rreq, req, account.tier)
    save = _saver(principal, rreq, history) if rreq.store else None
    timeout = cfg.timing.request_timeout
    if not rreq.stream:
        await run_to_end(choices, timeout, account)
        final = draft.final(choices)
        if save is not None:
            await save(final)
        return json_response(final)
    stream = ResponsesStream(choices, draft, timeout, cfg.timing.sse_ping_interval, cfg.timing.stream_stall_timeout,
                             account, save)
    return start_stream(stream, principal.tenant_name)


async def _history(principal: Principal, previous_id: str | None) -> list[ChatMessage]:
    """The conversation ``previous_id`` ended (its earlier turns, input and output), or [] for a first turn."""
    if previous_id is None:
        return []
    context = await app_state().tenancy.responses.read(principal.tenant_id, previous_id, "context")
    if context is None:
        raise APIError(404, f"Previous response with id '{previous_id}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return list(context)


def _answer_turn(final: dict[str, Any]) -> ChatMessage:
    """The response's output as the chat turn a next request continues from."""
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]}
    return {"role": "assistant", "content": final["output"][0]["content"][0]["text"]}


def _saver(principal: Principal, rreq: ResponsesRequest, history: list[ChatMessage]) -> Save:
    async def save(final: dict[str, Any]) -> None:
        context = [*history, *rreq.messages, _answer_turn(final)]
        await app_state().tenancy.responses.put(StoredResponse(final["id"], principal.tenant_id, time.time(), final,
                                                               rreq.input_items, context))

    return save


def _query(allowed: set[str]) -> None:
    unknown = sorted(set(request.args) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized query parameter: {unknown[0]}", param=unknown[0],
                          code="unrecognized_argument")


async def retrieve_response(response_id: str) -> Response:
    principal = await authorize()
    _query(set())  # include / stream / starting_after: nothing to include, no replay of a finished stream
    body = await app_state().tenancy.responses.read(principal.tenant_id, response_id, "body")
    if body is None:
        raise not_found(response_id)
    return json_response(body)


async def delete_response(response_id: str) -> Response:
    principal = await authorize()
    _query(set())
    if not await app_state().tenancy.responses.delete(principal.tenant_id, response_id):
        raise not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _list_params() -> tuple[int, str, str | None]:
    _query({"limit", "order", "after"})
    raw = request.args.get("limit", str(DEFAULT_LIST_LIMIT))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIST_LIMIT:
        raise bad_request(f"'limit' must be an integer in [1, {MAX_LIST_LIMIT}]", param="limit")
    order = request.args.get("order", "desc")  # OpenAI's default: newest first
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", param="order")
    return int(raw), order, request.args.get("after")


async def list_input_items(response_id: str) -> Response:
    principal = await authorize()
    limit, order, after = _list_params()
    items: list[dict[str, Any]] | None = await app_state().tenancy.responses.read(principal.tenant_id, response_id,
                                                                                  "input_items")
    if items is None:
        raise not_found(response_id)
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"No input item with id '{after}' in response '{response_id}'.", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit})
