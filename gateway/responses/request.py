"""Validate a ``POST /v1/responses`` body and translate it into a chat-completions body.

Every accepted field is listed in ``FIELDS``; any other is a 400 naming it, as on the chat route (nothing is silently
ignored). Sampling ranges, the structured-output schema and the context length are then checked by ``parse_chat``
itself on the translated body; its errors are renamed back to this API's fields (``max_output_tokens``, ``input``,
``text.format``) so a client is told about what it sent.

Function tools (this API's flat shape: ``{"type": "function", "name", "parameters", ...}``) and ``tool_choice``
(``{"type": "function", "name"}`` for a named one) become the chat body's ``tools`` and ``tool_choice``, so they get
chat's checks, prompt and grammar (``gateway.pipeline.tools``); ``ToolSettings`` keeps them as given, for the
response object to echo. Function-call input items are ``gateway.responses.items``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.base.errors import APIError, bad_request
from gateway.pipeline.protocol import GenerationRequest, parse_chat
from gateway.pipeline.tokenizer import GatewayTokenizer
from gateway.responses.items import ChatMessage, StoredItem, parse_input

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_bool(v: Any) -> bool:
    return type(v) is bool


def _is_any(v: Any) -> bool:  # structured fields, checked by their own parsers below
    return True


_TYPE_NAMES: dict[Callable[[Any], bool], str] = {
    _is_str: "a string", _is_int: "an integer", _is_number: "a number", _is_bool: "a boolean", _is_any: "a value"}
FIELDS: dict[str, Callable[[Any], bool]] = {
    "model": _is_str, "input": _is_any, "instructions": _is_str, "max_output_tokens": _is_int,
    "temperature": _is_number, "top_p": _is_number, "metadata": _is_any, "user": _is_str, "store": _is_bool,
    "stream": _is_bool, "previous_response_id": _is_str, "text": _is_any, "truncation": _is_str,
    "parallel_tool_calls": _is_bool, "tool_choice": _is_any, "tools": _is_any, "include": _is_any,
    "service_tier": _is_str, "prompt_cache_key": _is_str,  # checked by the chat parser they are handed to
}
# What ``include`` may name: extra output of hosted tools, images and reasoning, none of which this server has, so
# naming them adds nothing (agent SDKs send the list on every call). Output logprobs it does not serve: a 400.
_NOTHING_TO_INCLUDE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})


@dataclass(frozen=True)
class ToolSettings:
    """What the request said about tools, as the response object echoes it, and as the chat body says it."""

    tool_choice: Any = "auto"  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool = True
    tools: list[dict[str, Any]] = field(default_factory=list)  # this API's shape, strict filled in

    def chat_fields(self) -> dict[str, Any]:
        if not self.tools:
            return {}
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                   if t.get(k) is not None}} for t in self.tools]
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls}


@dataclass(frozen=True)
class ResponsesRequest:
    input_items: list[StoredItem]  # as stored and listed, each with its id
    messages: list[ChatMessage]  # the same input as chat messages
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    user: str | None
    store: bool
    stream: bool
    text_format: dict[str, Any]  # the response object's text.format, as OpenAI echoes it
    response_format: dict[str, Any] | None  # the same for the chat body (None: plain text)
    truncation: str = "disabled"
    tools: ToolSettings = field(default_factory=ToolSettings)
    service_tier: str | None = None  # OpenAI's; None: not asked
    prompt_cache_key: str | None = None  # OpenAI's routing hint


def _fields(body: Any) -> dict[str, Any]:
    """The body as a dict without nulls (null means "not given"), every key known and of the right JSON type."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in body.items():
        check = FIELDS.get(key)
        if check is None:
            raise bad_request(f"Unrecognized request argument supplied: {key}", param=key, code="unrecognized_argument")
        if value is None:
            continue
        if not check(value):
            raise bad_request(f"'{key}' must be {_TYPE_NAMES[check]}", param=key)
        out[key] = value
    return out


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'metadata' must be an object of string values", param="metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"'metadata' allows at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for k, v in value.items():
        if not 0 < len(k) <= MAX_METADATA_KEY:
            raise bad_request(f"'metadata' keys must have 1-{MAX_METADATA_KEY} characters", param="metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
            raise bad_request(f"'metadata.{k}' must be a string of at most {MAX_METADATA_VALUE} characters",
                              param="metadata")
    return dict(value)


def _unknown_keys(value: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad_request(f"Unrecognized argument supplied: {where}.{extra[0]}", param=f"{where}.{extra[0]}",
                          code="unrecognized_argument")


def _json_schema(fmt: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _unknown_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str):
        raise bad_request("Missing required parameter: 'text.format.name'.", param="text.format.name")
    if not isinstance(schema, dict):
        raise bad_request("Missing required parameter: 'text.format.schema' (a JSON schema object).",
                          param="text.format.schema")
    strict, description = fmt.get("strict"), fmt.get("description")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'text.format.strict' must be a boolean", param="text.format.strict")
    if description is not None and not isinstance(description, str):
        raise bad_request("'text.format.description' must be a string", param="text.format.description")
    js: dict[str, Any] = {"name": name, "schema": schema}
    js.update({k: v for k, v in (("strict", strict), ("description", description)) if v is not None})
    echoed = {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict), "description": description}
    return echoed, {"type": "json_schema", "json_schema": js}


def _text(value: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(text.format as echoed, the chat body's response_format or None)."""
    if value is None:
        return {"type": "text"}, None
    if not isinstance(value, dict):
        raise bad_request("'text' must be an object", param="text")
    _unknown_keys(value, {"format", "verbosity"}, "text")
    if value.get("verbosity") not in (None, "medium"):  # the only one a plain chat model has
        raise bad_request("'text.verbosity' other than 'medium' is not supported", param="text.verbosity",
                          code="unsupported_value")
    fmt = value.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format.type' must be one of 'text', 'json_object', 'json_schema'",
                          param="text.format.type")
    if fmt["type"] == "json_schema":
        return _json_schema(fmt)
    _unknown_keys(fmt, {"type"}, "text.format")
    return {"type": fmt["type"]}, (None if fmt["type"] == "text" else {"type": "json_object"})


_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _tool(value: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        got = value.get("type") if isinstance(value, dict) else None
        raise bad_request(f"Invalid value: '{got}'. This server runs function tools only (no hosted tools).",
                          param=f"{where}.type", code="unsupported_value")
    _unknown_keys(value, _TOOL_KEYS, where)
    # OpenAI's Responses default: a function tool is strict unless it says otherwise
    return {**value, "strict": value.get("strict", True), "description": value.get("description"),
            "parameters": value.get("parameters")}


def _tool_choice(value: Any) -> Any:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        return value
    raise bad_request("Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"name\": ...}.", param="tool_choice", code="invalid_value")


def _tools(fields: dict[str, Any]) -> ToolSettings:
    tools = fields.get("tools", [])
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", param="tools")
    choice = _tool_choice(fields.get("tool_choice", "auto"))
    if not tools and choice not in ("auto", "none"):
        raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                          "specified.", param="tool_choice", code="invalid_value")
    return ToolSettings(choice, fields.get("parallel_tool_calls", True), [_tool(t, i) for i, t in enumerate(tools)])


def _include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request("'include' must be an array of strings", param="include")
    for i, v in enumerate(value):
        if v not in _NOTHING_TO_INCLUDE:
            raise bad_request(f"Invalid value for 'include[{i}]': '{v}' is not supported by this server",
                              param=f"include[{i}]", code="unsupported_value")


def parse_responses(body: Any) -> ResponsesRequest:
    """Validate everything that needs neither the tokenizer nor the store."""
    fields = _fields(body)
    _include(fields.get("include"))
    if "input" not in fields:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    items, messages = parse_input(fields["input"])
    if fields.get("truncation", "disabled") != "disabled":
        raise bad_request("'truncation' other than 'disabled' is not supported: an input that does not fit the "
                          "context is refused", param="truncation", code="unsupported_value")
    max_output = fields.get("max_output_tokens")
    if max_output is not None and max_output < 1:
        raise bad_request(f"'max_output_tokens' must be at least 1, got {max_output}", param="max_output_tokens")
    previous = fields.get("previous_response_id")
    if previous is not None and not previous:
        raise bad_request("'previous_response_id' must not be empty", param="previous_response_id")
    text_format, response_format = _text(fields.get("text"))
    return ResponsesRequest(
        items, messages, fields.get("instructions"), previous, max_output, fields.get("temperature"),
        fields.get("top_p"), _metadata(fields.get("metadata")), fields.get("user"), fields.get("store", True),
        fields.get("stream", False), text_format, response_format, tools=_tools(fields),
        service_tier=fields.get("service_tier"), prompt_cache_key=fields.get("prompt_cache_key"))


def chat_body(req: ResponsesRequest, model: str, history: list[ChatMessage]) -> dict[str, Any]:
    """The chat-completions body this request runs as: instructions first (this request's only: OpenAI does not
    carry earlier ones over), then the earlier turns, then this input."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": model, "messages": [*messages, *history, *req.messages], "stream": req.stream}
    optional = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "user": req.user, "response_format": req.response_format, "service_tier": req.service_tier,
                "prompt_cache_key": req.prompt_cache_key}
    body.update({k: v for k, v in optional.items() if v is not None})
    body.update(req.tools.chat_fields())
    return body


# parse_chat's names for what this API calls otherwise (longest first: prefixes of each other).
_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("messages", "input"), ("].function.", "]."),
            ("'tool_choice.function'", "'tool_choice'"))


def _renamed(text: str) -> str:
    for chat_name, name in _RENAMES:
        text = text.replace(chat_name, name)
    return text


def parse_as_chat(body: Any, tok: GatewayTokenizer, max_model_len: int | None,
                  max_tokens_cap: int | None) -> GenerationRequest:
    """``parse_chat`` on the translated body; its refusals name this API's fields."""
    try:
        return parse_chat(body, tok, max_model_len, max_tokens_cap)
    except APIError as e:
        raise APIError(e.status, _renamed(e.message), code=e.code, param=_renamed(e.param) if e.param else None,
                       err_type=e.err_type, retry_after=e.retry_after, extra_headers=e.extra_headers) from None
