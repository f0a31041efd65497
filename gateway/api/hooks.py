"""App-wide request hooks and error handlers: rate-limit headers and request counting on every response, the
refused-request log line, and OpenAI-shaped JSON for every error (nothing about a prompt is ever logged)."""

from __future__ import annotations

import logging

from quart import Response, g, request
from werkzeug.exceptions import HTTPException, NotFound

from gateway.api.context import app_state
from gateway.api.generation_routes import GENERATION_ROUTES
from gateway.api.http_json import json_response
from gateway.base.errors import DRAIN_RETRY_AFTER_S, APIError, error_body
from gateway.base.principal import Principal

log = logging.getLogger("kvgate.gateway")


async def add_ratelimit_headers(response: Response) -> Response:
    state = app_state()
    headers: dict[str, str] | None = getattr(g, "ratelimit_headers", None)
    principal: Principal | None = getattr(g, "principal", None)
    if headers is None and principal is not None:
        headers = await state.tenancy.quota.headers(principal.scopes)
    for name, value in (headers or {}).items():
        response.headers.setdefault(name, value)
    request_id: str | None = getattr(g, "request_id", None)
    if request_id is not None:  # as OpenAI's x-request-id (the SDKs' _request_id): the ledger row's request_id
        response.headers.setdefault("x-request-id", request_id)
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    state.metrics.requests.labels(route, str(response.status_code), principal.tenant_name if principal else "").inc()
    if response.status_code >= 400 and request.path in GENERATION_ROUTES and not getattr(g, "admitted", False):
        # Refused before any work (auth, quota, validation): the request-finished line never comes.
        log.info("request refused", extra={"fields": {
            "event": "request_refused", "path": request.path, "http_status": response.status_code,
            "tenant_id": principal.tenant_id if principal else None,
            "key_id": principal.key_id if principal else None}})
    return response


async def refuse_while_draining() -> None:
    """A draining gateway admits nothing new on the API (503 + retry-after: another gateway will take it); pages,
    health, metrics and admin still answer."""
    if app_state().draining and request.path.startswith("/v1/"):
        raise APIError(503, "the gateway is shutting down: retry (another gateway will answer)", code="draining",
                       retry_after=DRAIN_RETRY_AFTER_S)


def _api_error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status, e.headers())


async def on_api_error(e: APIError) -> Response:
    return _api_error_response(e)


async def on_http_error(e: HTTPException) -> Response:
    status = e.code or 500
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = "request body too large" if status == 413 else (e.description or e.name)
    if isinstance(e, NotFound) and e.description == NotFound.description:
        # no route: OpenAI names the method and path; werkzeug's default text is about URLs typed in a browser
        message = f"Invalid URL ({request.method} {request.path})"
    return _api_error_response(APIError(status, message, code=code))


async def on_unexpected(e: Exception) -> Response:
    log.exception("unhandled %s in %s", type(e).__name__, request.path)
    return json_response(error_body("internal server error", "server_error", None, "internal_error"), 500)
