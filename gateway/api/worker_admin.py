"""Operator actions on this gateway's workers (the admin token): drain one. It takes no new requests from the
moment of the call, finishes those it holds, exits, and its supervisor starts a fresh process with the same id;
a rolling restart (``kvgatectl worker restart --all``) is one drain after another. The list of workers, with each
one's ``state`` (ready or draining), is ``GET /admin/workers`` (``gateway.api.web``).

    POST /admin/workers/<worker_id>/drain {timeout?: seconds} -> 202 {"worker", "pid", "state", "in_flight", "timeout"}

``timeout`` (default: the gateway's --drain-timeout) bounds how long the worker's requests may run; past it they
end with an error (code ``drain_timeout``) and the worker is shut down. Draining the only ready worker is
allowed: until its replacement says Hello, new requests get 503 ``no_worker`` with a retry-after.
"""

from __future__ import annotations

import math

from quart import Blueprint, Response

from gateway.api.admin import authorize_admin
from gateway.api.http_json import json_response, read_json
from gateway.api.state import GatewayState
from gateway.base.errors import APIError, bad_request

MAX_DRAIN_TIMEOUT_S = 3600.0  # the same bound as --drain-timeout


def _timeout(body: object, default: float) -> float:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    unknown = sorted(k for k in body if k != "timeout")
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}; known: timeout", param=unknown[0])
    value = body.get("timeout", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_DRAIN_TIMEOUT_S:
        raise bad_request(f"'timeout' must be a number of seconds in [0, {MAX_DRAIN_TIMEOUT_S:g}]", param="timeout")
    return float(value)


def create_worker_admin_blueprint(state: GatewayState) -> Blueprint:
    bp = Blueprint("worker_admin", __name__, url_prefix="/admin/workers")
    admin_token = state.config.tenancy.admin_token

    @bp.post("/<worker_id>/drain")
    async def drain(worker_id: str) -> Response:
        authorize_admin(admin_token)
        timeout = _timeout(await read_json(allow_empty=True), state.config.drain_timeout)
        try:
            w = state.pool.drain(worker_id, timeout)
        except KeyError:
            known = ", ".join(sorted(state.pool.workers)) or "none"
            raise APIError(404, f"no live worker {worker_id!r} on this gateway (live: {known})",
                           code="worker_not_found", param="worker_id") from None
        return json_response({"worker": w.worker_id, "pid": w.hello.pid, "state": "draining",
                              "in_flight": len(w.requests), "timeout": timeout}, 202)

    return bp
