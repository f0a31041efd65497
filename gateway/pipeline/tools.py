"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

How a call looks in text, for every model: one block per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

separated by a newline. That is the Hermes syntax Qwen and Hermes templates render natively (``"native"``: the
template gets ``tools`` and renders the calls and results itself); a template without tool syntax (smollm2's
ChatML) gets the same syntax described in a system message and tool results as user turns (``"generic"``, as
llama.cpp's generic format does for templates without tools). Either way the grammar engine constrains the
output (``grammar_spec``): under ``auto`` the answer is either text that does not start with ``<`` or calls;
under ``required`` or a named function it is calls from the first token, each ``{"name", "arguments"}`` object
held to that tool's JSON Schema, so even a 135M model emits calls that parse and validate. What the model wrote
is split back into content and ``tool_calls`` by ``gateway.pipeline.tool_stream``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.base.errors import bad_request
from gateway.pipeline.response_format import closed, validate_schema

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit on one request's tools
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}

Mode = Literal["none", "auto", "required", "named"]
Format = Literal["native", "generic", "llama_json"]


@dataclass(frozen=True)
class Syntax:
    """How a call is written in text: a wrapped ``{"name", "arguments"}`` block (Hermes, and the generic format),
    or Llama 3.x's bare ``{"name", "parameters"}`` object (its JSON tool calling: one call an answer)."""

    start: str  # opens a call ("" for a bare object)
    end: str  # closes it
    args_key: str
    sep: str | None  # between parallel calls; None: one call an answer
    text_may_not_start: str  # an answer in text may not start with this (it would start a call)


SYNTAX: dict[Format, Syntax] = {
    "native": Syntax(CALL_START + "\n", "\n" + CALL_END, "arguments", "\n", "<"),  # Hermes templates: newline between
    # Generic: nothing between calls: given a newline after a call, smollm2 took it and was then held to a second,
    # identical call, and so on until max_tokens; given none, it ends its answer right after </tool_call>.
    "generic": Syntax(CALL_START + "\n", "\n" + CALL_END, "arguments", "", "<"),
    "llama_json": Syntax("", "", "parameters", None, "{"),
}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON Schema of an object
    strict: bool
    given: dict[str, Any]  # the tool as the client wrote it: what a native template lists

    def openai_shape(self) -> dict[str, Any]:
        return self.given


@dataclass(frozen=True)
class ToolConfig:
    tools: tuple[Tool, ...]
    mode: Mode
    named: str | None  # the function tool_choice names (mode "named")
    parallel: bool  # several calls in one answer
    fmt: Format = "generic"  # how the model's template writes calls (GatewayTokenizer.tool_format)

    @property
    def syntax(self) -> Syntax:
        return SYNTAX[self.fmt]

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none"

    def allowed(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.mode != "named" or t.name == self.named)


# ---- the request's fields -----------------------------------------------------------------------

def _tool(value: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(f"'{where}.type' must be 'function' (the only tool type this server runs)",
                          param=f"{where}.type")
    if set(value) - {"type", "function"}:
        raise bad_request(f"Unrecognized argument in {where}: {sorted(set(value) - {'type', 'function'})[0]}",
                          param=where, code="unrecognized_argument")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"Missing required parameter: '{where}.function'.", param=f"{where}.function")
    if set(fn) - _FUNCTION_KEYS:
        extra = sorted(set(fn) - _FUNCTION_KEYS)[0]
        raise bad_request(f"Unrecognized argument in {where}.function: {extra}", param=f"{where}.function.{extra}",
                          code="unrecognized_argument")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise bad_request(f"Invalid '{where}.function.name': must be 1-64 letters, digits, '_' or '-'",
                          param=f"{where}.function.name", code="invalid_value")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{where}.function.description' must be a string", param=f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.function.strict' must be a boolean", param=f"{where}.function.strict")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}  # OpenAI: no parameters means a function of no arguments
    param = f"{where}.function.parameters"
    if not isinstance(params, dict):
        raise bad_request(f"Invalid schema for function '{name}': the schema must be a JSON object", param=param,
                          code="invalid_function_parameters")
    if params.get("type", "object") != "object":
        raise bad_request(f"Invalid schema for function '{name}': schema must be a JSON Schema of 'type: "
                          f"\"object\"', got 'type: \"{params.get('type')}\"'.", param=param,
                          code="invalid_function_parameters")
    params = {**params, "type": "object"}  # arguments are always an object, whatever the schema left open
    validate_schema(params, param, f"function '{name}'", code="invalid_function_parameters")
    return Tool(name, description, params, bool(strict), value)


def _tool_choice(value: Any, names: set[str]) -> tuple[Mode, str | None]:
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {"type", "function"}:
        fn = value.get("function")
        if isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str):
            if fn["name"] not in names:
                raise bad_request(f"Invalid value for 'tool_choice': function '{fn['name']}' is not among "
                                  "'tools'.", param="tool_choice", code="invalid_value")
            return "named", fn["name"]
    raise bad_request("Invalid value for 'tool_choice': expected 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice",
                      code="invalid_value")


def parse_tools(fields: dict[str, Any], fmt: Format = "generic") -> ToolConfig | None:
    """The request's tool settings, or None when it gives no tools (then tool_choice must be absent too);
    ``fmt``: how the model's template writes calls."""
    tools = fields.get("tools")
    if tools is None:
        for key in ("tool_choice", "parallel_tool_calls"):
            if key in fields:
                raise bad_request(f"Invalid value for '{key}': '{key}' is only allowed when 'tools' are "
                                  "specified.", param=key, code="invalid_value")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("Invalid 'tools': expected a non-empty array of tools.", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"Invalid 'tools': array too long, at most {MAX_TOOLS} tools.", param="tools")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"Invalid 'tools': function name '{dup}' is given twice.", param="tools")
    mode, named = _tool_choice(fields.get("tool_choice", "auto"), set(names))
    return ToolConfig(parsed, mode, named, bool(fields.get("parallel_tool_calls", True)), fmt)


# ---- the grammar --------------------------------------------------------------------------------

def _call_schema(tools: tuple[Tool, ...], args_key: str) -> dict[str, Any]:
    variants = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: closed(t.parameters)},
                 "required": ["name", args_key], "additionalProperties": False} for t in tools]
    # Compact JSON: a small model does not spend tokens on whitespace, and a random one cannot pad forever.
    return {"anyOf": variants, "x-guidance": {"whitespace_flexible": False}}


def grammar_spec(cfg: ToolConfig, answer: dict[str, Any] | None) -> str:
    """The structured-output spec (workers/structured.py's ``lark`` kind) that holds the answer to ``cfg``.
    ``answer``, the request's own response format spec, shapes the text alternative under ``auto``."""
    syn = cfg.syntax
    if not cfg.parallel or syn.sep is None:
        calls = "calls: call"
    else:
        calls = f"calls: call ({json.dumps(syn.sep)} call)*" if syn.sep else "calls: call+"
    call = f"call: {json.dumps(syn.start)} body {json.dumps(syn.end)}" if syn.start else "call: body"
    lines = ["%llguidance {}", "start: calls" if cfg.mode != "auto" else "start: answer | calls", calls, call,
             f"body: %json {json.dumps(_call_schema(cfg.allowed(), syn.args_key))}"]
    if cfg.mode == "auto":
        if answer is None:
            lines.append("answer: TEXT")
            # any text that does not start a call
            lines.append(f"TEXT: /[^{re.escape(syn.text_may_not_start)}](.|\\n)*/")
        elif answer["type"] in ("json_schema", "json_object"):
            schema = answer.get("schema", {"type": "object"})
            lines.append(f"answer: %json {json.dumps(schema)}")
        else:
            raise bad_request("'tools' cannot be combined with guided_regex or guided_choice",
                              param="tools")
    grammar = "\n".join(lines)
    _check_grammar(grammar)
    return json.dumps({"type": "lark", "grammar": grammar}, separators=(",", ":"))


def _check_grammar(grammar: str) -> None:
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(grammar), None)
    except Exception as e:  # noqa: BLE001  the pieces were each valid: what fails is their combination
        is_error, messages = True, [str(e)]
    if is_error:
        raise bad_request(f"Invalid 'tools': {'; '.join(messages) or 'unsupported'}", param="tools",
                          code="invalid_function_parameters")


# ---- the prompt ---------------------------------------------------------------------------------

def calls_text(calls: list[dict[str, Any]], sep: str) -> str:
    """Calls (``{"name", "arguments"}`` with arguments an object) as the model writes them."""
    return sep.join(f"{CALL_START}\n{json.dumps(c, ensure_ascii=False, separators=(',', ':'))}\n{CALL_END}"
                     for c in calls)


def system_prompt(cfg: ToolConfig) -> str:
    """The generic format's instructions, for templates without tool syntax. The same whatever ``tool_choice``
    says (the grammar enforces that): an agent's turns (``required``, then ``auto``) share this prefix, so the
    next turn hits the prefix cache."""
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                   "parameters": t.parameters}, ensure_ascii=False) for t in cfg.tools)
    example = calls_text([{"name": "<function-name>", "arguments": {"<argument>": "<value>"}}], "")
    rule = "Answer the user directly, or, when a tool is needed, reply with tool calls only."
    many = " One block per call." if cfg.parallel else " Call one tool at a time."
    return (f"You can call these tools (each line is one function and the JSON Schema of its arguments):\n{listed}"
            f"\nTo call a tool, reply with\n{example}\n{rule}{many} Tool results come back in <tool_response> "
            "blocks.")
