"""Server-Sent Events as the gateway sends them: ``data: {json}`` events, ``: ping`` comments, ``data: [DONE]``.

Parsing is deliberately strict about shape (an error event must be OpenAI's ``{"error": {message, type, param,
code}}``) and lenient about content (a chunk that does not parse is counted, not fatal): a drill reports what
the deployment sent, it does not crash on it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

ERROR_KEYS = frozenset({"message", "type", "param", "code"})


@dataclass(frozen=True)
class Event:
    done: bool = False
    request_id: str | None = None
    error: dict[str, Any] | None = None
    has_content: bool = False
    malformed: bool = False


def error_of(raw: bytes | str) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI-shaped error body, or None when the body is not one."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS or not isinstance(err.get("message"), str):
        return None
    return err


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return True
    return False


def parse_event(data: str) -> Event:
    if data == "[DONE]":
        return Event(done=True)
    try:
        chunk = json.loads(data)
    except ValueError:
        return Event(malformed=True)
    if not isinstance(chunk, dict):
        return Event(malformed=True)
    if "error" in chunk:
        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
        return Event(error=err)
    rid = chunk.get("id")
    return Event(request_id=rid if isinstance(rid, str) else None, has_content=_has_content(chunk))


class SSEReader:
    """Async iterator of ``Event`` over a response's lines (comments and blank lines skipped)."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self._lines = lines

    def __aiter__(self) -> SSEReader:
        return self

    async def __anext__(self) -> Event:
        async for line in self._lines:
            if line.startswith("data:"):
                return parse_event(line[5:].strip())
        raise StopAsyncIteration
