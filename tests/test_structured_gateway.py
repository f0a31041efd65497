"""Structured outputs through a real gateway: response_format / guided_* parsed into the worker's grammar spec,
refusals in OpenAI's error shape, and end to end (``kvgate serve`` on the tiny model with smollm2's tokenizer):
sampled outputs at temperature 1.0 parse and validate against the schema."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from gateway.base.errors import APIError
from gateway.pipeline.response_format import closed, structured_spec
from tests.test_gateway_support import MODEL, Server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 999},
                   "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
    "required": ["name", "n", "ok", "kind"], "additionalProperties": False,
}


def _fmt(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **extra}}}


def test_spec_from_response_format_and_guided_fields() -> None:
    assert json.loads(structured_spec(_fmt(SCHEMA, strict=True)) or "") == {"type": "json_schema",
                                                                          "schema": SCHEMA}
    assert json.loads(structured_spec({"response_format": {"type": "json_object"}}) or "") == {
        "type": "json_object"}
    assert structured_spec({"response_format": {"type": "text"}}) is None
    assert structured_spec({}) is None
    assert json.loads(structured_spec({"guided_choice": ["x", "y"]}) or "")["choices"] == ["x", "y"]
    assert json.loads(structured_spec({"guided_regex": "[a-z]+"}) or "")["pattern"] == "[a-z]+"
    assert json.loads(structured_spec({"guided_json": json.dumps(SCHEMA)}) or "")["schema"] == SCHEMA


def test_listed_properties_are_the_only_ones_a_schema_admits() -> None:
    """A schema that lists properties and says nothing of others holds only those (vLLM's default, xgrammar's
    strict mode); a free-form object stays open. Checked in the spec the worker compiles."""
    loose = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "object"}},
             "required": ["name"]}
    for fields in (_fmt(loose), {"guided_json": loose}, {"guided_json": json.dumps(loose)}):
        schema = json.loads(structured_spec(fields) or "")["schema"]
        assert schema["additionalProperties"] is False, fields
        assert "additionalProperties" not in schema["properties"]["tags"]  # free-form: any keys
    assert "additionalProperties" not in loose  # the request's own schema is untouched


def test_closing_reaches_nested_shapes_and_leaves_free_form_ones_open() -> None:
    item = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {"type": "object", "properties": {
        "points": {"type": "array", "items": item},
        "either": {"anyOf": [item, {"type": "string"}]},
        "meta": {"type": "object"},  # free-form: any keys
        "open": {"type": "object", "properties": {"k": {}}, "additionalProperties": {"type": "integer"}},
        "both": {"allOf": [item, {"properties": {"y": {}}}]},
        "ref": {"$ref": "#/$defs/p"}}, "$defs": {"p": item}}
    got = closed(schema)
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert props["points"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {
        "type": "string"}
    assert "additionalProperties" not in props["meta"]
    assert props["open"]["additionalProperties"] == {"type": "integer"}
    assert props["both"] == schema["properties"]["both"]
    assert got["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in item  # the request's own schema is not changed


@pytest.mark.parametrize("fields, param", [
    (_fmt({"type": "strnig"}), "response_format.json_schema.schema"),
    (_fmt({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}),
     "response_format.json_schema.schema"),
    (_fmt(SCHEMA, strict="yes"), "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),  # the second of the order named
])
def test_bad_specs_are_400_naming_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        structured_spec(fields)
    assert e.value.status == 400 and e.value.param == param


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=server.headers, timeout=120)


def test_chat_json_schema_end_to_end(server: Server) -> None:
    for seed in range(8):
        r = _post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a thing"}], "temperature": 1.0, "seed": seed,
            "max_tokens": 120, **_fmt(SCHEMA, strict=True)})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completions_guided_choice_and_streaming_regex(server: Server) -> None:
    r = _post(server, "/v1/completions", {"prompt": "pick", "guided_choice": ["left", "right"], "max_tokens": 8,
                                          "temperature": 1.0, "seed": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("left", "right")
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=120, json={
            "model": MODEL, "prompt": "code", "guided_regex": "[A-Z]{2}[0-9]{3}", "max_tokens": 16,
            "stream": True}) as s:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                       if line.startswith("data: {"))
    assert len(text) == 5 and text[:2].isupper() and text[2:].isdigit()


def test_unsupported_schema_is_openai_shaped_400(server: Server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                               **_fmt({"type": "object", "properties": {"a": {"$ref": "#/x"}}})})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "response_format.json_schema.schema"
    assert "Invalid schema for response_format 'thing'" in err["message"]
