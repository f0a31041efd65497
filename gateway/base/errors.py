"""OpenAI-shaped errors: one exception type every layer raises, one JSON shape every error response has.

``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status, whether the failure is a bad
parameter (400), a bad key (401), an unknown model (404), an oversized body (413), no capacity (503 with an
accurate ``retry-after``) or a timeout (504). Messages name fields and sizes, never prompt or completion text.
"""

from __future__ import annotations

import math
from typing import Any

# OpenAI's error "type" per status class; clients (the SDKs) key on status, humans on type/code.
DRAIN_RETRY_AFTER_S = 1.0  # a draining gateway's 503: retry at once, the load balancer sends it elsewhere
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape. Raise it anywhere in request handling."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 err_type: str | None = None, retry_after: float | None = None,
                 extra_headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.err_type = err_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after
        self.extra_headers = extra_headers or {}  # e.g. the limiter's x-ratelimit-* and retry-after-ms

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.retry_after is not None:
            # Whole seconds (RFC 9110), rounded up so a client that obeys it never comes back too early.
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 400 or self.status == 404 or self.status == 413:
            headers["x-should-retry"] = "false"  # the OpenAI SDKs honour this: retrying cannot help
        headers.update(self.extra_headers)
        return headers


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    """A ``model`` that is not one the caller may use: a name nobody registered and another tenant's adapter alike."""
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def model_not_allowed(model: str, param: str = "model") -> APIError:
    """The caller's key is not allowed ``model`` (its ``allowed_models``); ``param``: where the model was named."""
    return APIError(403, f"Your API key is not allowed to use the model `{model}`.", code="model_not_allowed",
                    param=param)


def unavailable(message: str, retry_after: float, code: str = "no_capacity") -> APIError:
    return APIError(503, message, code=code, retry_after=retry_after)


def store_unavailable(message: str) -> APIError:
    """A store call (stored responses, the Batch API's files and batches, a batch key's lookup) failed or took too
    long: a 503 to retry in a second."""
    return APIError(503, message, code="store_unavailable", retry_after=1.0)
