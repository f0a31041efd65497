"""JSON in and out of Quart handlers, strictly: one parser and one response builder for every route."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, current_app, g, request

from gateway.base.errors import bad_request


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status=status, headers=headers,
                    content_type="application/json")


async def read_json(*, allow_empty: bool = False) -> Any:
    """The request body as JSON; 400 for bad UTF-8, bad JSON, NaN/Infinity or absurd nesting, 413 (raised by
    Quart) past MAX_CONTENT_LENGTH. An empty body is ``{}`` when ``allow_empty``."""
    raw = await request.get_data(cache=False)
    if not isinstance(raw, bytes):
        raise TypeError("request.get_data returned text; expected bytes")
    if allow_empty and not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("request body nests too deeply") from None
    except ValueError as e:  # JSONDecodeError and our constant rejection
        raise bad_request(f"request body is not valid JSON: {e.__class__.__name__}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# app.config: the (method, path) of requests whose handler authorizes before it reads the body (uploads)
READ_IN_HANDLER_KEY = "KVGATE_READ_IN_HANDLER"


def _has_body() -> bool:
    return (request.content_length or 0) > 0 or "chunked" in request.headers.get("Transfer-Encoding", "").lower()


async def read_body_first() -> None:
    """``before_request``: take in the whole body before any answer can leave. Hypercorn 0.18's trio worker wedges
    a keep-alive connection whose response went out before its request body arrived (a 401 or 404 answered before
    parsing, a GET with a body): the client's next request on it is never answered. Found by the bad-input chaos
    drill; bounded by MAX_CONTENT_LENGTH (413) and BODY_TIMEOUT (408), as the routes' own reads are.

    Not for uploads (READ_IN_HANDLER_KEY): their limit is --max-file-bytes, and reading first would take in up to
    that much from a caller before its key is looked at. Their handlers authorize, then read (``body_read``); a
    refusal goes out with the body unread and ``Connection: close`` (close_if_body_unread), so no next request
    waits on that connection (tests/test_upload_refused_body.py: the rest of the body is not held)."""
    if (request.method, request.path) in current_app.config.get(READ_IN_HANDLER_KEY, ()):
        return
    if _has_body():
        await request.get_data(cache=True)  # read_json takes it from the cache
        g.body_read = True


def body_read() -> None:
    """An upload handler has read its whole body: its answer may keep the connection alive."""
    g.body_read = True


async def close_if_body_unread(response: Response) -> Response:
    """``after_request``: ``Connection: close`` on a response that went out with its request body unread (413,
    408), so the client opens a fresh connection instead of waiting on a wedged one."""
    if _has_body() and not g.get("body_read", False):
        response.headers["Connection"] = "close"
    return response
