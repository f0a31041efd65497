"""A chat request's ``messages``: checked in OpenAI's shapes, then made into what the model's template renders.

Besides system (or developer), user and assistant turns with text, a conversation of an agent carries assistant
turns with ``tool_calls`` (their ``arguments`` a JSON string) and ``role: "tool"`` results. A template with tool
syntax (``native``) gets them as Hugging Face templates expect (arguments as objects, tools in ``tools``); for
any other template (``generic``) they become text in the syntax of ``gateway.pipeline.tools``: the calls in the
assistant turn, each run of tool results one turn of ``<tool_response>`` blocks (role ``tool`` where the template
renders it, else ``user``: ``GatewayTokenizer.tool_role``), and the tool list in the system message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.base.errors import bad_request
from gateway.pipeline.tools import Format, ToolConfig, calls_text, system_prompt

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEYS = {"role", "content", "name"}
_ASSISTANT_KEYS = _KEYS | {"tool_calls", "refusal", "audio", "function_call", "annotations"}
_NULL_ONLY = ("refusal", "audio", "function_call")  # what the SDK sends back of an answer it got; nothing to render


@dataclass(frozen=True)
class Message:
    role: str  # "developer" is already "system"
    content: str
    calls: tuple[dict[str, Any], ...] = ()  # {"name", "arguments": object} of an assistant turn


def content(value: Any, where: str, allow_null: bool = False) -> str:
    if value is None and allow_null:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only (this server has no vision or audio models)
        texts: list[str] = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}[{i}]' must be a text content part", param=where)
            if set(part) - {"type", "text"}:
                raise bad_request(f"'{where}[{i}]' has unsupported keys", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}' must be a string or an array of text parts", param=where)


def _call(value: Any, where: str) -> dict[str, Any]:
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type", "function") != "function" or set(value) - {"id", "type",
                                                                                                "function"}:
        raise bad_request(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}", param=where)
    name, args = fn.get("name"), fn.get("arguments", "")
    if not isinstance(name, str) or not isinstance(args, str) or set(fn) - {"name", "arguments"}:
        raise bad_request(f"'{where}.function' must have a string 'name' and a string 'arguments'",
                          param=f"{where}.function")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        raise bad_request(f"'{where}.function.arguments' is not valid JSON", param=f"{where}.function.arguments",
                          code="invalid_value") from None
    return {"name": name, "arguments": parsed}


def _assistant(m: dict[str, Any], where: str) -> Message:
    for key in _NULL_ONLY:
        if m.get(key) is not None:
            raise bad_request(f"'{where}.{key}' is not supported (must be null)", param=f"{where}.{key}")
    if m.get("annotations"):
        raise bad_request(f"'{where}.annotations' is not supported", param=f"{where}.annotations")
    raw_calls = m.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise bad_request(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    calls = tuple(_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw_calls))
    return Message("assistant", content(m.get("content"), f"{where}.content", allow_null=bool(calls)), calls)


def parse_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    out: list[Message] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}", param=f"{where}.role")
        allowed = _ASSISTANT_KEYS if role == "assistant" else _KEYS | {"tool_call_id"} if role == "tool" else _KEYS
        unknown = sorted(set(m) - allowed)
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {where}.{unknown[0]}",
                              param=f"{where}.{unknown[0]}", code="unrecognized_argument")
        if role == "assistant":
            out.append(_assistant(m, where))
            continue
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"Missing required parameter: '{where}.tool_call_id'.", param=f"{where}.tool_call_id")
        out.append(Message("system" if role == "developer" else role, content(m.get("content"), f"{where}.content")))
    return out


# ---- for the template ---------------------------------------------------------------------------

def _native(msgs: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in msgs:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.calls:
            d["tool_calls"] = [{"type": "function", "function": dict(c)} for c in m.calls]
        out.append(d)
    return out


def _generic(msgs: list[Message], tools: ToolConfig | None, tool_role: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in msgs:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("_tool"):  # a run of results is one user turn, as Hermes templates do
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": tool_role, "content": block, "_tool": True})
        elif m.calls:
            text = calls_text(list(m.calls), "")
            out.append({"role": "assistant", "content": f"{m.content}\n{text}" if m.content else text})
        else:
            out.append({"role": m.role, "content": m.content})
    if tools is not None and tools.calls_allowed:
        rules = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{rules}"
        else:
            out.insert(0, {"role": "system", "content": rules})
    return [{k: v for k, v in d.items() if k != "_tool"} for d in out]


def template_input(msgs: list[Message], tools: ToolConfig | None, fmt: Format,
                   tool_role: str = "user") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: ``tools`` is given to native templates only."""
    if fmt != "generic":  # the template writes calls itself (Hermes, Llama 3.x JSON)
        shown = [t.openai_shape() for t in tools.tools] if tools is not None and tools.calls_allowed else None
        return _native(msgs), shown
    return _generic(msgs, tools, tool_role), None
