"""From a choice's generated text to OpenAI's ``content`` and ``tool_calls``, as it streams.

``ToolCallParser.feed`` takes text as the detokenizer releases it and returns what may be shown now: content text,
or ``delta.tool_calls`` entries in OpenAI's streaming shape (the first of a call with its ``id``, ``type`` and
``name`` and empty ``arguments``, then argument fragments). The whole answer goes through the same parser for a
non-streamed response, so the concatenated fragments of a stream are byte for byte the ``arguments`` of the
plain response (and the ``name`` and argument order are the grammar's, ``gateway.pipeline.tools``).

The answer is text or calls, decided by its first characters: while they could still begin ``<tool_call>``
they are held back. A call's arguments are streamed as they arrive, their end found by a small JSON scanner
(strings and nesting), so nothing after the arguments object leaks into them.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from gateway.pipeline.tools import SYNTAX, Syntax


def _head(args_key: str) -> re.Pattern[str]:
    """The start of a call's object up to its arguments value; the grammar writes "name" first."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + args_key + r'"\s*:\s*(?=\S)')


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))  # OpenAI's shape: call_ + 24


class JsonScanner:
    """Finds where one JSON value ends, fed piece by piece: tracks nesting and strings only (the grammar has
    already made it valid JSON; this only has to know when it closed)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's end, or None while it is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif ch == '"':
                self.in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                if self.depth == 0:
                    return i  # closes what encloses a bare value
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.started and self.depth == 0 and (ch.isspace() or ch == ","):
                return i  # the end of a bare number or literal
            elif not ch.isspace():
                self.started = True
        return None


@dataclass
class _Call:
    body_at: int  # where the call's JSON object starts in the parser's text
    id: str = ""
    name: str | None = None
    args_at: int = -1  # where its arguments value starts, once the name is known
    sent: int = -1  # text[args_at:sent] has been handed out as argument fragments
    scanner: JsonScanner = field(default_factory=JsonScanner)
    args_end: int | None = None


class ToolCallParser:
    """One choice's answer; ``feed`` returns (content, tool_call deltas) to send now."""

    def __init__(self, syntax: Syntax = SYNTAX["generic"]) -> None:
        self._start, self._end = syntax.start.strip(), syntax.end.strip()  # "" for a bare JSON object
        self._head_re = _head(syntax.args_key)
        self.text = ""
        self.mode = "undecided"  # then "text" or "calls"
        self.content = ""
        self.calls: list[_Call] = []
        self._pos = 0  # in calls mode: text[:_pos] is fully parsed
        self._current: _Call | None = None
        self.sent_role = False  # a stream's first delta of this choice carries the role

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        if self.mode == "undecided":
            opener = self._start or "{"  # a bare object's call starts at its brace
            if self.text.startswith(opener):
                self.mode = "calls"
            elif opener.startswith(self.text) and not final:
                return "", []  # could still be a call: hold it back
            else:
                self.mode = "text"
                text = self.text
        if self.mode == "text":
            self.content += text
            return text, []
        return "", _merge(self._parse_calls())

    def _parse_calls(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            call = self._current
            if call is None:
                rest = self.text[self._pos:]
                stripped = rest.lstrip()
                if not stripped.startswith(self._start or "{"):
                    return out  # a separator, part of the next call's opening, or the end
                self._pos += len(rest) - len(stripped) + len(self._start)
                self._current = call = _Call(self._pos)
                self.calls.append(call)
            if call.name is None and not self._head(call, out):
                return out
            if call.args_end is None:
                self._arguments(call, out)
                if call.args_end is None:
                    return out
            end = self.text.find(self._end or "}", call.args_end)  # a bare object ends at its own brace
            if end < 0:
                return out
            self._pos, self._current = end + len(self._end or "}"), None

    def _head(self, call: _Call, out: list[dict[str, Any]]) -> bool:
        m = self._head_re.match(self.text, call.body_at)
        if m is None:
            return False
        call.id, call.name = new_call_id(), json.loads(f'"{m.group(1)}"')
        call.args_at = call.sent = m.end()
        out.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})
        return True

    def _arguments(self, call: _Call, out: list[dict[str, Any]]) -> None:
        new = self.text[call.sent:]
        end = call.scanner.feed(new)
        upto = call.sent + (end if end is not None else len(new))
        if end is not None:
            call.args_end = upto
        if upto > call.sent:
            out.append({"index": len(self.calls) - 1, "function": {"arguments": self.text[call.sent:upto]}})
            call.sent = upto

    # ---- the whole answer -------------------------------------------------------------------------

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls named so far, OpenAI's message shape (``arguments`` as far as generated)."""
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": self.text[c.args_at:c.sent]}}
                for c in self.calls if c.name is not None]


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive argument fragments of one call as one entry (what a client accumulates is unchanged); a call's
    first entry (its id and name, empty arguments, as OpenAI sends it) stays on its own."""
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d["index"] and "id" not in merged[-1] and "id" not in d:
            fn = merged[-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + d["function"]["arguments"]
        else:
            merged.append({**d, "function": dict(d["function"])})
    return merged
