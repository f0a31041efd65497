"""Tool calling in the Responses API. Units: function tools in this API's flat shape become chat tools (their
refusals renamed back), ``function_call`` / ``function_call_output`` input items become the conversation's call and
result turns, and an answer of calls becomes ``function_call`` output items, streamed as OpenAI's typed events (each
validated by the SDK's types, ids the same in the stream and the final object). Over HTTP: the tiny model through
the SDK (calls that validate, a second turn from ``previous_response_id`` with the result); and openai-agents in its
default mode, which speaks the Responses API, running a tool loop on smollm2."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response as SDKResponse

from gateway.base.errors import APIError
from gateway.pipeline.protocol import parse_chat
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from gateway.responses.objects import ResponseDraft
from gateway.responses.request import chat_body, parse_as_chat, parse_responses
from tests.test_gateway_support import MODEL, Server
from tests.test_responses_units import EVENTS, _choices
from tests.test_tool_calling_smollm2 import run_async, weather_agent

pytestmark = pytest.mark.timeout(600)

PARAMS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
          "required": ["unit", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}
CALL_TEXT = '<tool_call>\n{"name":"get_weather","arguments":{"unit":"c","days":2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_tools_and_call_items_translate_to_chat(tok: GatewayTokenizer) -> None:
    req = parse_responses({"model": "m", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                           "parallel_tool_calls": False, "input": [
                               {"role": "user", "content": "weather?"},
                               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                "arguments": '{"unit":"c","days":1}'},
                               {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                                "arguments": '{"unit":"f","days":2}'},
                               {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
                               {"type": "function_call_output", "call_id": "call_2",
                                "output": [{"type": "input_text", "text": "64F"}]}]})
    body = chat_body(req, "m", [])
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                               "parameters": PARAMS, "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in body["messages"][1]["tool_calls"]] == ["call_1", "call_2"]  # one turn: parallel
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "call_2", "content": "64F"}
    assert [i["type"] for i in req.input_items] == ["message", "function_call", "function_call",
                                                    "function_call_output", "function_call_output"]
    assert req.input_items[1]["id"].startswith("fc_") and req.input_items[3]["id"].startswith("fco_")
    gen = parse_chat(body, tok, 4096)
    assert gen.tools is not None and gen.tools.mode == "named" and not gen.tools.parallel
    bad = {"model": "m", "input": "x", "tools": [{**TOOL, "parameters": {"type": "object", "properties": {
        "a": {"type": "strnig"}}}}]}
    with pytest.raises(APIError) as e:
        parse_as_chat(chat_body(parse_responses(bad), "m", []), tok, 4096, None)
    assert e.value.param == "tools[0].parameters" and e.value.code == "invalid_function_parameters"


@pytest.mark.trio  # RequestHandle reads Trio's clock
async def test_calls_are_function_call_items_streamed_and_final(tok: GatewayTokenizer) -> None:
    req = parse_responses({"model": "m", "input": "weather?", "tools": [TOOL], "tool_choice": "required"})
    gen = parse_chat(chat_body(req, "m", []), tok, 4096)
    draft = ResponseDraft("resp_x", "m", 1_700_000_000, req, gen)
    text = CALL_TEXT + CALL_TEXT.replace('"days":2', '"days":3')
    events = [*draft.opening()]
    for i in range(0, len(text), 5):
        events += draft.deltas(text[i:i + 5], final=i + 5 >= len(text))
    final = draft.final(_choices(text, "stop"))
    events += draft.closing(final)
    parsed = [EVENTS.validate_python(json.loads(e.split("\ndata: ", 1)[1])) for e in events]
    kinds = [p.type for p in parsed]
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.output_item.done") == 2
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    response = SDKResponse.model_validate(final)
    assert [(o.type, o.name, json.loads(o.arguments)["days"]) for o in response.output] == [  # type: ignore[union-attr]
        ("function_call", "get_weather", 2), ("function_call", "get_weather", 3)]
    added = [p.item for p in parsed if p.type == "response.output_item.added"]
    assert [(a.id, a.call_id) for a in added] == [(o.id, o.call_id) for o in response.output]  # type: ignore[union-attr]
    for i, o in enumerate(response.output):
        streamed = "".join(p.delta for p in parsed if p.type == "response.function_call_arguments.delta"
                           and p.output_index == i)
        assert streamed == o.arguments  # type: ignore[union-attr]
    text_draft = ResponseDraft("resp_y", "m", 1_700_000_000, req, gen)  # text, not calls: the message item
    events = [*text_draft.opening(), *text_draft.deltas("It is sunny", True)]
    assert SDKResponse.model_validate(text_draft.final(_choices("It is sunny", "stop"))).output_text == "It is sunny"
    assert "response.output_item.added" in events[2] and "response.output_text.delta" in events[-1]


def test_tool_turns_over_http(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)
    first = client.responses.create(model=MODEL, input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[list-item]
                                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=120)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert first.tools[0].strict is True and first.tool_choice == "required"  # echoed, strict by default
    with client.responses.stream(model=MODEL, input="weather?", tools=[TOOL], tool_choice="required",  # type: ignore[list-item]
                                 parallel_tool_calls=False, max_output_tokens=120) as stream:
        kinds = {e.type for e in stream}
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert streamed.output[0].type == "function_call"
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL],  # type: ignore[list-item]
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}],
                                     tool_choice="none", max_output_tokens=8)
    assert second.output[0].type == "message"
    items = client.responses.input_items.list(second.id).data
    assert [i.type for i in items] == ["function_call_output"]


def test_openai_agents_default_responses_model_runs_a_tool_loop(smollm2_server: Server) -> None:
    from agents import OpenAIResponsesModel, Runner

    client = openai.AsyncOpenAI(base_url=smollm2_server.url + "/v1", api_key=smollm2_server.api_key)
    agent, calls = weather_agent(OpenAIResponsesModel(model="smollm2", openai_client=client))
    result: Any = run_async(lambda: Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls == ["Paris"] and "sunny" in result.final_output.lower()
