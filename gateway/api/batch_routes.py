"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches`` (newest first; ``limit``, ``after``),
``GET /v1/batches/{id}`` and ``POST /v1/batches/{id}/cancel``.

A create only checks and records the batch (``validating``); whichever gateway leads the batch runner
(``gateway.batches.runner``) starts it, runs its lines and writes its output and error files, so any gateway on the
same store answers for any batch. A cancel asks for it (``cancelling``); the runner lets the lines in flight finish
and ends it ``cancelled``. Batches and their input files belong to one tenant: another tenant's batch id, or a
batch over another tenant's file, is the same 404 as an unknown one.
"""

from __future__ import annotations

import time
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from gateway.api.context import app_state, authorize
from gateway.api.files_routes import check_query, list_limit, page_body
from gateway.api.http_json import json_response, read_json
from gateway.base.errors import APIError, bad_request, model_not_allowed
from gateway.batches.jsonl import ENDPOINTS
from gateway.batches.objects import batch_object, new_batch_id
from tenancy.batch_store import BatchRecord

COMPLETION_WINDOW_S = {"24h": 24 * 3600.0}  # the one window OpenAI offers
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20  # OpenAI's
_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")


def register(app: QuartTrio) -> None:
    app.add_url_rule("/v1/batches", view_func=create_batch, methods=["POST"])
    app.add_url_rule("/v1/batches", view_func=list_batches, methods=["GET"])
    app.add_url_rule("/v1/batches/<batch_id>", view_func=retrieve_batch, methods=["GET"])
    app.add_url_rule("/v1/batches/<batch_id>/cancel", view_func=cancel_batch, methods=["POST"])


def not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", code="not_found", param="batch_id")


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise bad_request(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} pairs", param="metadata")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"'metadata' keys have at most {MAX_METADATA_KEY_CHARS} characters and its values "
                              f"are strings of at most {MAX_METADATA_VALUE_CHARS}", param="metadata")
    return dict(value)


def _create_fields(body: Any) -> tuple[str, str, str, dict[str, str] | None]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for key in body:
        if key not in _FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key[:64]}", param=key[:64],
                              code="unrecognized_argument")
    file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
    if not isinstance(file_id, str) or not file_id:
        raise bad_request("'input_file_id' is required (a file uploaded with purpose 'batch')",
                          param="input_file_id")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if window not in COMPLETION_WINDOW_S:
        raise bad_request("'completion_window' must be '24h'", param="completion_window")
    return file_id, endpoint, window, _metadata(body.get("metadata"))


async def create_batch() -> Response:
    principal = await authorize()
    state = app_state()
    file_id, endpoint, window, metadata = _create_fields(await read_json())
    stored = state.tenancy.batches
    upload = await stored.file(principal.tenant_id, file_id)
    if upload is None:
        raise APIError(404, f"No such File object: {file_id}", code="not_found", param="input_file_id")
    if upload.purpose != "batch":
        raise bad_request(f"File {file_id} has purpose '{upload.purpose}'; a batch runs a file uploaded with "
                          "purpose 'batch'", param="input_file_id")
    if upload.endpoint != endpoint:
        raise bad_request(f"The input file's requests are to {upload.endpoint} (line 1), not to {endpoint}",
                          param="endpoint", code="mismatched_url")
    model = upload.model or state.config.model_name  # a file uploaded before files kept their model: the base's
    if not principal.allows_model(model):
        raise model_not_allowed(model, param="input_file_id")
    now = time.time()
    record = BatchRecord(new_batch_id(), principal.tenant_id, principal.key_id, now, "validating", endpoint, file_id,
                         window, metadata, now + COMPLETION_WINDOW_S[window], model=model)
    await stored.create_batch(record)
    return json_response(batch_object(record, model))


async def list_batches() -> Response:
    principal = await authorize()
    check_query({"limit", "after"})
    limit = list_limit(DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
    after = request.args.get("after")
    found = await app_state().tenancy.batches.batch_page(principal.tenant_id, limit, after)
    if found is None:
        raise bad_request(f"No batch with id '{after}' to list after.", param="after")
    model = app_state().config.model_name
    return json_response(page_body([batch_object(r, model) for r in found[0]], found[1]))


async def retrieve_batch(batch_id: str) -> Response:
    principal = await authorize()
    check_query(set())
    record = await app_state().tenancy.batches.batch(principal.tenant_id, batch_id)
    if record is None:
        raise not_found(batch_id)
    return json_response(batch_object(record, app_state().config.model_name))


async def cancel_batch(batch_id: str) -> Response:
    principal = await authorize()
    check_query(set())
    await read_json(allow_empty=True)  # the SDK sends no body; any body is read (a keep-alive must not wedge)
    record = await app_state().tenancy.batches.cancel_batch(principal.tenant_id, batch_id, time.time())
    if record is None:
        raise not_found(batch_id)
    if record.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status '{record.status}'.", code="batch_not_cancellable")
    return json_response(batch_object(record, app_state().config.model_name))
