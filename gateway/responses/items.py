"""The ``input`` of a Responses request: a string, or a list of input items. Each item becomes two things: the item
as stored and listed (``GET /v1/responses/{id}/input_items``, with an id), and the chat message the model sees.

Item types are dispatched through ``ITEM_PARSERS``: messages, ``function_call`` (an earlier answer's call: an
assistant turn with ``tool_calls``; consecutive calls are one turn, as the model made them) and
``function_call_output`` (its result: a ``tool`` message).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from gateway.base.errors import bad_request

ROLES = ("user", "system", "developer", "assistant")
MAX_INPUT_ITEMS = 2048  # the body's size bounds it too; this bounds the per-item work before any tokenizing
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_STATUSES = ("in_progress", "completed", "incomplete")
# The part types each side of a conversation may carry (OpenAI's rule); images, files and audio are refused, since
# this server serves text models only.
_INPUT_PART = ("input_text", frozenset({"type", "text"}))
_OUTPUT_PART = ("output_text", frozenset({"type", "text", "annotations", "logprobs"}))

StoredItem = dict[str, Any]
ChatMessage = dict[str, Any]


def new_id(prefix: str) -> str:
    """An object id in OpenAI's form: ``resp_…``, ``msg_…`` (48 hex digits of randomness)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    """The content parts of one message, each as stored: ``[{type, text}]`` (+ ``annotations`` for output)."""
    kind, allowed = _OUTPUT_PART if role == "assistant" else _INPUT_PART
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content parts", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != kind:
            got = part.get("type") if isinstance(part, dict) else None
            raise bad_request(f"Invalid value: '{got}'. Supported values for a {role} message's content are: "
                              f"'{kind}' (this server serves text models only).", param=f"{at}.type")
        extra = sorted(set(part) - allowed)
        if extra:
            raise bad_request(f"Unrecognized argument supplied: {at}.{extra[0]}", param=f"{at}.{extra[0]}",
                              code="unrecognized_argument")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{at}.text' must be a string", param=f"{at}.text")
        stored: dict[str, Any] = {"type": kind, "text": part["text"]}
        if kind == "output_text":
            stored["annotations"] = []  # annotations cite tools' sources: none here, and none are read back
        parts.append(stored)
    return parts


def _message(item: dict[str, Any], where: str) -> tuple[StoredItem, ChatMessage]:
    extra = sorted(set(item) - _MESSAGE_KEYS)
    if extra:
        raise bad_request(f"Unrecognized argument supplied: {where}.{extra[0]}", param=f"{where}.{extra[0]}",
                          code="unrecognized_argument")
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}", param=f"{where}.role")
    status = item.get("status")
    if status is not None and status not in _STATUSES:
        raise bad_request(f"'{where}.status' must be one of {', '.join(_STATUSES)}", param=f"{where}.status")
    if item.get("phase") is not None:  # a hint for OpenAI's own models, which this server cannot honour
        raise bad_request(f"'{where}.phase' is not supported", param=f"{where}.phase", code="unsupported_value")
    item_id = item.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= 128):
        raise bad_request(f"'{where}.id' must be a string of 1-128 characters", param=f"{where}.id")
    parts = _parts(item.get("content"), role, where)
    stored: StoredItem = {"id": item_id or new_id("msg"), "type": "message", "role": role,
                          "status": status or "completed", "content": parts}
    return stored, {"role": role, "content": "".join(p["text"] for p in parts)}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"Missing required parameter: '{where}.{key}' (a string).", param=f"{where}.{key}")
    return value


def _check_common(item: dict[str, Any], keys: frozenset[str], where: str) -> None:
    extra = sorted(set(item) - keys)
    if extra:
        raise bad_request(f"Unrecognized argument supplied: {where}.{extra[0]}", param=f"{where}.{extra[0]}",
                          code="unrecognized_argument")
    status = item.get("status")
    if status is not None and status not in _STATUSES:
        raise bad_request(f"'{where}.status' must be one of {', '.join(_STATUSES)}", param=f"{where}.status")


def _function_call(item: dict[str, Any], where: str) -> tuple[StoredItem, ChatMessage]:
    _check_common(item, frozenset({"type", "id", "call_id", "name", "arguments", "status"}), where)
    call_id, name, args = (_string(item, k, where) for k in ("call_id", "name", "arguments"))
    stored: StoredItem = {"id": item.get("id") or new_id("fc"), "type": "function_call", "call_id": call_id,
                          "name": name, "arguments": args, "status": item.get("status") or "completed"}
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return stored, {"role": "assistant", "content": None, "tool_calls": [call]}


def _function_call_output(item: dict[str, Any], where: str) -> tuple[StoredItem, ChatMessage]:
    _check_common(item, frozenset({"type", "id", "call_id", "output", "status"}), where)
    call_id = _string(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, list):  # content parts: text only
        output = "".join(p["text"] for p in _parts(output, "user", f"{where}.output"))
    if not isinstance(output, str):
        raise bad_request(f"'{where}.output' must be a string or an array of input_text parts",
                          param=f"{where}.output")
    stored: StoredItem = {"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": call_id, "output": output, "status": item.get("status") or "completed"}
    return stored, {"role": "tool", "tool_call_id": call_id, "content": output}


ItemParser = Callable[[dict[str, Any], str], tuple[StoredItem, ChatMessage]]
ITEM_PARSERS: dict[str, ItemParser] = {"message": _message, "function_call": _function_call,
                                       "function_call_output": _function_call_output}


def parse_input(value: Any) -> tuple[list[StoredItem], list[ChatMessage]]:
    """The request's items as stored (ids given) and as chat messages, in order; 400 naming the item otherwise."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of input items", param="input")
    if len(value) > MAX_INPUT_ITEMS:
        raise bad_request(f"'input' allows at most {MAX_INPUT_ITEMS} items", param="input")
    items: list[StoredItem] = []
    messages: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")  # an "easy" message ({role, content}) has no type
        parser = ITEM_PARSERS.get(kind) if isinstance(kind, str) else None
        if parser is None:
            raise bad_request(f"Invalid value: '{kind}'. Supported values are: 'message', 'function_call' and "
                              "'function_call_output'.", param=f"{where}.type")
        stored, message = parser(item, where)
        items.append(stored)
        last = messages[-1] if messages else None
        if message.get("tool_calls") and last is not None and last.get("tool_calls"):
            last["tool_calls"] = [*last["tool_calls"], *message["tool_calls"]]  # parallel calls: one turn
        else:
            messages.append(message)
    return items, messages
