"""The Responses API's units (no server): validation and its refusals naming the field, the translation into a chat
body (and ``parse_chat``'s refusals renamed to this API's fields), and the response object and every stream event
validated against the official SDK's own pydantic types."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent

from gateway.base.errors import APIError
from gateway.base.handle import RequestHandle
from gateway.pipeline.choices import Child, Choices
from gateway.pipeline.generation import OutputAssembler
from gateway.pipeline.protocol import parse_chat
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from gateway.responses.objects import ResponseDraft
from gateway.responses.request import chat_body, parse_as_chat, parse_responses
from ipc.messages import RequestOutputMsg
from tests.test_gateway_units import _FakeTok

PICK = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"],
        "additionalProperties": False}
PICK_FORMAT = {"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}}
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_input_items_and_translation() -> None:
    req = parse_responses({"model": "m", "instructions": "Be brief", "max_output_tokens": 7, "temperature": 0,
                           "metadata": {"k": "v"}, "store": False, "text": PICK_FORMAT, "tools": [],
                           "tool_choice": "none", "parallel_tool_calls": False, "truncation": "disabled",
                           "input": [{"role": "developer", "content": "dev"},
                                     {"type": "message", "role": "assistant", "id": "msg_old",
                                      "content": [{"type": "output_text", "text": "a", "annotations": []},
                                                  {"type": "output_text", "text": "b"}]},
                                     {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
    assert [m["role"] for m in req.messages] == ["developer", "assistant", "user"]
    assert req.messages[1]["content"] == "ab"
    ids = [item["id"] for item in req.input_items]
    assert ids[1] == "msg_old" and ids[0].startswith("msg_") and len(set(ids)) == 3
    assert req.input_items[2]["content"] == [{"type": "input_text", "text": "hi"}]
    assert (req.store, req.metadata, req.tools.tool_choice, req.tools.parallel_tool_calls) == (False, {"k": "v"},
                                                                                                "none", False)
    body = chat_body(req, "m", [{"role": "user", "content": "earlier"}])
    assert [m["content"] for m in body["messages"]] == ["Be brief", "earlier", "dev", "ab", "hi"]
    assert body["max_completion_tokens"] == 7 and body["temperature"] == 0
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK,
                                                                              "strict": True}}
    plain = parse_responses({"model": "m", "input": "just text"})
    assert plain.messages == [{"role": "user", "content": "just text"}] and plain.store and not plain.stream
    assert plain.input_items[0]["content"] == [{"type": "input_text", "text": "just text"}]


@pytest.mark.parametrize("body,param", [
    ({"seed": 1}, "seed"), ({"top_logprobs": 2}, "top_logprobs"), ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "function": {}}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
    ({"input": []}, "input"), ({"input": None}, "input"), ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"text": {"verbosity": "high"}},
                                                                      "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "schema": PICK}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"), ({"store": "yes"}, "store"),
    ({"previous_response_id": ""}, "previous_response_id"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_responses({"model": "m", "input": "x", **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_chat_refusals_are_renamed(tok: GatewayTokenizer) -> None:
    def refusal(body: dict[str, Any]) -> APIError:
        req = parse_responses({"model": "m", "input": "x", **body})
        with pytest.raises(APIError) as e:
            parse_as_chat(chat_body(req, "m", []), tok, 64, None)
        return e.value

    too_long = refusal({"max_output_tokens": 100})
    assert too_long.code == "context_length_exceeded" and too_long.param == "max_output_tokens"
    schema = refusal({"text": {"format": {"type": "json_schema", "name": "s",
                                          "schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}})
    assert schema.param == "text.format.schema" and "response_format" not in schema.message
    assert refusal({"temperature": -1}).param == "temperature"
    assert refusal({"input": "word " * 100}).param == "input"


def _choices(text: str, finish: str) -> Choices:
    choices = Choices(None, "resp_x")  # type: ignore[arg-type]  # never released here
    asm = OutputAssembler(_FakeTok(), (), False)  # type: ignore[arg-type]
    choices.children.append(Child(RequestHandle("resp_x", "w0", 3), asm))
    asm.add(RequestOutputMsg("resp_x", [ord(c) for c in text], finish, 2, None, None, None))
    return choices


@pytest.mark.trio  # RequestHandle reads Trio's clock
async def test_objects_and_events_parse_as_the_sdk_types(tok: GatewayTokenizer) -> None:
    req = parse_responses({"model": "m", "input": "hi", "metadata": {"a": "b"}, "instructions": "x",
                           "text": PICK_FORMAT})
    gen = parse_chat(chat_body(req, "m", []), tok, 4096)
    for finish, status in (("stop", "completed"), ("length", "incomplete")):
        draft = ResponseDraft("resp_x", "m", 1_700_000_000, req, gen)
        final = draft.final(_choices("abc", finish))
        parsed = SDKResponse.model_validate(final)  # validated, not merely constructed: every type must fit
        assert parsed.status == status and parsed.output_text == "abc" and parsed.metadata == {"a": "b"}
        assert parsed.usage is not None and parsed.usage.output_tokens == 3
        assert parsed.usage.input_tokens_details.cached_tokens == 2
        assert (parsed.incomplete_details is not None) == (status == "incomplete")
        events = [*draft.opening(), *draft.deltas("ab", False), *draft.deltas("c", True), *draft.closing(final),
                  *draft.failed(APIError(503, "gone", code="worker_died"))]
        numbers = []
        for text in events:
            head, data = text.removesuffix("\n\n").split("\n")
            event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
            assert head == f"event: {event.type}"
            numbers.append(event.sequence_number)
        assert numbers == list(range(len(events)))
