"""The table of pathological structured-output specs of the hostile-schemas drill (what a tenant may put in
``response_format`` / ``guided_json`` / ``guided_regex`` to make a grammar engine work hard), and how one such
request is sent and its answer recorded.

Each case makes its request's extra body fields from a salt. The salt goes into the spec itself (a title, an
enum value, a property name, an optional prefix of a regex), so no two requests share a canonical spec: the
worker caches compiled grammars by that spec, and a repeated one would be served from the cache and cost nothing.
Cases are sized against the product's own limits (``gateway.pipeline.response_format.MAX_SPEC_CHARS``, 100,000
characters; llguidance's recursion and lexer limits) on both sides: some pass them and reach a worker's compile
threads, some are refused by the gateway. The drill records which; it does not presume it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from chaos.load import MAX_ERROR_BODY
from chaos.sse import error_of

Fields = dict[str, Any]


@dataclass(frozen=True)
class SchemaCase:
    name: str
    fields: Callable[[str], Fields]  # salt -> the request's structured-output fields


def nested(depth: int, salt: str) -> dict[str, Any]:
    """An object nested ``depth`` deep, each level with a required integer and the next level (the issue's
    40-level case is 4.8 KB)."""
    schema: dict[str, Any] = {"type": "string", "maxLength": 3, "title": salt}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   f"n{i}": schema},
                  "required": [f"k{i}", f"n{i}"], "additionalProperties": False}
    return schema


def enum(n: int, salt: str) -> dict[str, Any]:
    return {"enum": [salt, *(f"value-{i}" for i in range(n - 1))]}


def any_of(n: int, salt: str) -> dict[str, Any]:
    """``n`` object alternatives, each with a property of its own: a wide union for the Earley parser."""
    return {"title": salt, "anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                      "required": [f"p{i}"], "additionalProperties": False} for i in range(n)]}


def _json(schema: Callable[[str], dict[str, Any]]) -> Callable[[str], Fields]:
    return lambda salt: {"guided_json": schema(salt)}


def _format(schema: Callable[[str], dict[str, Any]]) -> Callable[[str], Fields]:
    return lambda salt: {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "hostile", "schema": schema(salt)}}}


def _regex(pattern: str) -> Callable[[str], Fields]:
    # An optional literal prefix keeps the language (a string of "a"s) and makes each request's spec unique.
    return lambda salt: {"guided_regex": f"(?:{salt})?{pattern}"}


def cases() -> list[SchemaCase]:
    return [
        SchemaCase("nested 40 levels (response_format)", _format(lambda s: nested(40, s))),
        SchemaCase("nested 200 levels", _json(lambda s: nested(200, s))),
        SchemaCase("enum of 5,000 values", _json(lambda s: enum(5_000, s))),
        SchemaCase("enum of 20,000 values", _json(lambda s: enum(20_000, s))),
        SchemaCase("enum of 100,000 values", _json(lambda s: enum(100_000, s))),
        SchemaCase("regex (a+)+$", _regex("(a+)+$")),
        SchemaCase("regex ((a*)*)*b", _regex("((a*)*)*b")),
        SchemaCase("regex (a|aa)+a{1,1000}$", _regex("(a|aa)+a{1,1000}$")),
        SchemaCase("anyOf of 500 objects", _json(lambda s: any_of(500, s))),
        SchemaCase("anyOf of 3,000 objects", _json(lambda s: any_of(3_000, s))),
    ]


@dataclass
class HostileAnswer:
    case: str
    status: int | None = None  # None: a transport error or no answer in time
    code: str | None = None
    retry_after: str | None = None
    shape_ok: bool = True
    hung: bool = False
    transport: str | None = None
    seconds: float = 0.0
    unfinished: bool = True  # still in flight when its phase was stopped: not judged

    @property
    def label(self) -> str:
        if self.hung:
            return "no answer"
        return self.transport or f"{self.status}" + (f" {self.code}" if self.code else "")


async def send(client: httpx.AsyncClient, api_key: str, case: str, body: bytes, deadline_s: float,
               answer: HostileAnswer | None = None) -> HostileAnswer:
    """POST one pre-serialized body to the chat route and record how it was answered (never raises for a
    transport error or a deadline: those are answers too). ``answer``, when given, is filled in place, so a
    caller that is cancelled mid-request still holds it (``unfinished``)."""
    out = answer or HostileAnswer(case)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    started = trio.current_time()
    with trio.move_on_after(deadline_s) as scope:
        try:
            r = await client.post("/v1/chat/completions", content=body, headers=headers)
        except httpx.TransportError as e:
            out.transport = type(e).__name__
        else:
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200:
                err = error_of(r.content[:MAX_ERROR_BODY])
                out.shape_ok = err is not None
                out.code = None if err is None or err.get("code") is None else str(err.get("code"))
    out.hung, out.unfinished = scope.cancelled_caught, False
    out.seconds = trio.current_time() - started
    return out


class LoopLag:
    """The drill's own event-loop lag while it measures: a gap it would add to the streams' reads by itself (a
    1.5 MB body serialized on the loop would be one), reported beside the latencies it could inflate."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        last = trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            self.worst = max(self.worst, now - last - 0.005)
            last = now
