"""Tool calling over HTTP (``kvgate serve`` on the tiny random-weight model): whatever a random model samples, the
grammar makes every call parse and validate against its tool's schema; the response and the stream have OpenAI's
shapes to the byte (ids, indices, role and ``content: null`` on a call's first chunk, argument fragments,
``finish_reason``); the official SDK accumulates the stream into the same calls as the plain response; a
template with Hermes tool syntax (``tests/data/hermes_template.jinja``) gets the native format."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.test_gateway_support import MODEL, Server, start_server
from tests.test_tool_calling import HERMES_TEMPLATE

pytestmark = pytest.mark.timeout(300)

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT = "/v1/chat/completions"


def _post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + CHAT, json={"model": MODEL, "messages": ASK, "tools": TOOLS, **body},
                      headers=server.headers, timeout=120)


def _check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def test_required_and_named_calls_always_validate(server: Server) -> None:
    for seed in range(6):
        r = _post(server, {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0,
                           "seed": seed, "max_tokens": 200})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None and choice["message"]["role"] == "assistant"
        assert len(choice["message"]["tool_calls"]) == 1
        _check_calls(choice["message"]["tool_calls"])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _post(server, {"tool_choice": named, "parallel_tool_calls": False, "temperature": 1.0, "seed": 1,
                       "max_tokens": 200})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI ends a call it was told to make with "stop"
    assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} == {"get_time"}
    _check_calls(choice["message"]["tool_calls"])


def _sse(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + CHAT, headers=server.headers, timeout=120, json={
            "model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True, **body}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_stream_has_openai_shapes_and_adds_up_to_the_plain_answer(server: Server) -> None:
    body = {"tool_choice": "required", "temperature": 1.0, "seed": 3, "max_tokens": 200, "parallel_tool_calls": False}
    plain = _post(server, body).json()["choices"][0]["message"]["tool_calls"]
    chunks = _sse(server, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = deltas[0]
    assert first["role"] == "assistant" and first["content"] is None
    [head] = first["tool_calls"]  # as OpenAI's: id, type and name alone, arguments empty, fragments after
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"]["arguments"] == ""
    assert head["function"]["name"] == plain[0]["function"]["name"]
    fragments = [head["function"]["arguments"]]
    for d in deltas[1:]:
        for tc in d.get("tool_calls", []):
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            fragments.append(tc["function"]["arguments"])
        assert "content" not in d and "role" not in d
    assert "".join(fragments) == plain[0]["function"]["arguments"]  # same seed, same tokens: same bytes
    assert len(fragments) > 2  # the arguments arrived in pieces, as they were generated
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}


def test_sdk_stream_accumulation_and_n(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                        parallel_tool_calls=False, temperature=1.0, seed=5,
                                        max_tokens=200) as stream:
        kinds = {type(ev).__name__ for ev in stream}
        final = stream.get_final_completion()
    assert "FunctionToolCallArgumentsDoneEvent" in kinds and "ContentDeltaEvent" not in kinds
    msg = final.choices[0].message
    _check_calls([tc.model_dump() for tc in msg.tool_calls or []])
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                       parallel_tool_calls=False, n=2, temperature=1.0, seed=7, max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        _check_calls([tc.model_dump() for tc in c.message.tool_calls or []])


def test_auto_answers_text_or_valid_calls(server: Server) -> None:
    seen = set()
    for seed in range(8):
        choice = _post(server, {"temperature": 1.0, "seed": seed, "max_tokens": 60}).json()["choices"][0]
        msg = choice["message"]
        if msg.get("tool_calls"):
            seen.add("calls")
            assert msg["content"] is None
            complete = msg["tool_calls"] if choice["finish_reason"] != "length" else msg["tool_calls"][:-1]
            if complete:
                _check_calls(complete)
        else:
            seen.add("text")
            assert not msg["content"].startswith("<")
    assert seen  # (which of the two a random model picks is up to its weights)


def test_bad_tools_are_openai_shaped_400s(server: Server) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}}]
    r = _post(server, {"tools": bad})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "tools[0].function.parameters"
    assert err["code"] == "invalid_function_parameters"
    r = _post(server, {"tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert _post(server, {"tool_choice": "required", "max_tokens": 60}).status_code == 200  # still serving


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("hermes-model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    srv = start_server(d, tmp_path_factory.mktemp("hermes") / "gateway.log")
    yield srv
    srv.stop()


def test_native_template_calls_parallel(hermes_server: Server) -> None:
    for seed in range(3):
        r = _post(hermes_server, {"tool_choice": "required", "temperature": 1.0, "seed": seed, "max_tokens": 200})
        choice = r.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        _check_calls(calls if choice["finish_reason"] != "length" else calls[:-1] or calls)
    tokens = httpx.post(hermes_server.url + "/tokenize", headers=hermes_server.headers, timeout=60,
                        json={"model": MODEL, "messages": ASK}).json()["tokens"]
    assert tokens  # the route renders the native template too


def test_llama_json_template_calls(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.test_tool_calling import LLAMA_TEMPLATE

    d = tmp_path / "llama-model"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(LLAMA_TEMPLATE)
    srv = start_server(d, tmp_path / "gateway.log")
    try:
        for seed in range(3):
            r = _post(srv, {"tool_choice": "required", "temperature": 1.0, "seed": seed, "max_tokens": 200})
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
            _check_calls(choice["message"]["tool_calls"])
    finally:
        srv.stop()
