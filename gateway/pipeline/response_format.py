"""Structured outputs in the request: OpenAI's ``response_format`` and vLLM's ``guided_json`` /
``guided_choice`` / ``guided_regex``, turned into the grammar spec the worker compiles (workers/structured.py).

The schema is checked here with the grammar engine's own validator (llguidance, no tokenizer needed, no torch),
so an unsupported feature is a 400 in OpenAI's shape before any worker sees it. Compiling against the
vocabulary, with its time bound, stays on the worker, which refuses a schema that takes too long.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from gateway.base.errors import bad_request

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
MAX_SPEC_CHARS = 100_000  # a schema this large is not a response format, it is an attack on the compiler
_GUIDED = ("guided_json", "guided_choice", "guided_regex")


def _any(v: Any) -> bool:
    return True


STRUCTURED_FIELDS: dict[str, Callable[[Any], bool]] = {"response_format": _any, **{k: _any for k in _GUIDED}}


def validate_schema(schema: Any, param: str, what: str, code: str = "invalid_json_schema") -> None:
    """A 400 naming ``what`` (e.g. "response_format 'x'") unless the grammar engine can run ``schema``."""
    import llguidance

    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"Invalid schema for {what}: the schema must be a JSON object", param=param, code=code)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception as e:  # noqa: BLE001  whatever the engine throws at a schema is the schema's fault: 400
        is_error, messages = True, [str(e)]
    if is_error:
        raise bad_request(f"Invalid schema for {what}: {'; '.join(messages) or 'unsupported'}", param=param,
                          code=code)


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its ``properties`` and says nothing of others closed to them
    (``additionalProperties: false``), as vLLM's default grammar backend (xgrammar's strict mode) does: what a
    response format, ``guided_json`` or a tool's arguments hold. JSON Schema's default admits any other key, and a
    small model fills an object with made-up keys (repeated ones included) until max_tokens: smollm2 asked for
    Paris' weather wrote ``{"city":"Paris","type":"string",
    "properties":{"temperature":{...},"temperature":"25.5"},"temperature":"25.5"}`` (a key twice) and stopped on
    length. A free-form object (no ``properties``) stays open, and so does anything under ``allOf``, whose parts
    each list only some of the properties (closing each part would refuse the others' keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if set(value) - {"type", "json_schema"}:
        extra = sorted(set(value) - {"type", "json_schema"})[0]
        raise bad_request(f"Unrecognized argument in response_format: {extra}", param=f"response_format.{extra}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"Invalid value: '{kind}'. Supported values are: 'text', 'json_object' and "
                          "'json_schema'.", param="response_format.type")
    js = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(js, dict):
        raise bad_request("Missing required parameter: 'response_format.json_schema'.", param=param)
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"Unrecognized argument in {param}: {sorted(unknown)[0]}", param=param)
    name = js.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise bad_request("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                          param=f"{param}.name")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", param=f"{param}.strict")
    schema = js.get("schema", {})  # OpenAI: a missing schema means any JSON value shape it describes: {}
    validate_schema(schema, f"{param}.schema", f"response_format '{name}'")
    return {"type": "json_schema", "schema": closed(schema)}


def _guided(fields: dict[str, Any]) -> dict[str, Any] | None:
    if "guided_json" in fields:
        schema = fields["guided_json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise bad_request("'guided_json' must be a JSON schema", param="guided_json") from None
        validate_schema(schema, "guided_json", "response_format 'guided_json'")
        return {"type": "json_schema", "schema": closed(schema)}
    if "guided_choice" in fields:
        choices = fields["guided_choice"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise bad_request("'guided_choice' must be a non-empty list of non-empty strings",
                              param="guided_choice")
        return {"type": "choice", "choices": choices}
    pattern = fields["guided_regex"]
    if not isinstance(pattern, str) or not pattern:
        raise bad_request("'guided_regex' must be a non-empty string", param="guided_regex")
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_regex(pattern), None)
    if is_error:
        raise bad_request(f"Invalid 'guided_regex': {'; '.join(messages)}", param="guided_regex")
    return {"type": "regex", "pattern": pattern}


def structured_spec(fields: dict[str, Any]) -> str | None:
    """The grammar spec (JSON) for SamplingParams.structured, or None; at most one way of asking."""
    asked = [k for k in ("response_format", *_GUIDED) if k in fields]
    if len(asked) > 1:
        raise bad_request(f"give one of {', '.join(asked)}, not several", param=asked[1])
    if not asked:
        return None
    spec = _response_format(fields["response_format"]) if asked[0] == "response_format" else _guided(fields)
    if spec is None:
        return None
    text = json.dumps(spec, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise bad_request(f"the structured output spec is over {MAX_SPEC_CHARS} characters", param=asked[0])
    return text
