"""OpenAI's Responses API (``/v1/responses``) over HTTP (``kvgate serve`` on the tiny model) with the official
``openai`` SDK (the units are in tests/test_responses_units.py): create (plain, and streamed with the SDK's stream
helper), retrieve, input_items with pagination, delete, ``previous_response_id`` chaining (the second turn's prompt
is exactly the first turn's conversation plus the new input), ``text.format`` json_schema, tenant isolation,
``store: false``, refusals in OpenAI's shape, the ledger row, and a disconnect that cancels the work.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from tests.tenancy_support import make_tenant, store_of
from tests.test_gateway_support import MODEL, Server, start_server, wait_idle
from tests.test_responses_units import EVENTS, PICK_FORMAT
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Steps held 2 ms, so the disconnect test's long output outlives the worker's 0.5 s stats interval."""
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("responses") / "gateway.log",
                       env={"KVGATE_DEBUG_STEP_DELAY": "0.002"})
    yield srv
    srv.stop()


def _client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with _client(server) as c:
        yield c  # closed after: an idle keep-alive connection holds a gateway's graceful shutdown for 5 s


def _count(server: Server, messages: list[dict[str, str]]) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_create_retrieve_list_delete(client: openai.OpenAI, server: Server) -> None:
    inputs = [{"role": "user", "content": f"message {i}"} for i in range(3)]
    r = client.responses.create(model=MODEL, input=inputs, instructions="Be brief",  # type: ignore[arg-type]
                                max_output_tokens=4, metadata={"topic": "test"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.instructions == "Be brief" and r.metadata == {"topic": "test"} and r.store is True
    [message] = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert r.usage is not None and r.usage.output_tokens <= 4
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens == _count(server, [{"role": "system", "content": "Be brief"}, *inputs])
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = client.responses.input_items.list(r.id)  # newest first, OpenAI's default
    assert [item.content[0].text for item in listed.data] == ["message 2", "message 1", "message 0"]  # type: ignore[union-attr]
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert page.has_more and [i.id for i in page.data] == [i.id for i in listed.data[::-1][:2]]
    rest = client.responses.input_items.list(r.id, order="asc", limit=2, after=page.data[-1].id)
    assert not rest.has_more and [i.id for i in rest.data] == [listed.data[0].id]
    assert len(list(client.responses.input_items.list(r.id, limit=1))) == 3  # the SDK's auto-pagination
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}", headers=server.headers, timeout=30)
    assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_stream_with_the_sdk_helper(client: openai.OpenAI) -> None:
    """A json_schema format makes the tiny model finish (its grammar ends the output), so the stream completes."""
    with client.responses.stream(model=MODEL, input="pick one", text=PICK_FORMAT,  # type: ignore[arg-type]
                                 max_output_tokens=64, metadata={"s": "1"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas and json.loads(deltas)["a"] in ("yes", "no")
    stored = client.responses.retrieve(final.id)  # the object the stream ended with
    assert (stored.status, stored.output_text, stored.usage, stored.metadata) == (final.status, final.output_text,
                                                                                  final.usage, {"s": "1"})
    assert stored.output[0].id == final.output[0].id and stored.created_at == final.created_at


def test_raw_stream_is_typed_and_ends_incomplete(server: Server) -> None:
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        head, data = block.split("\n")
        events.append(EVENTS.validate_python(json.loads(data.removeprefix("data: "))))
        assert head == f"event: {events[-1].type}"
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == text and last.response.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model=MODEL, input="first question", instructions="Be brief",
                                    max_output_tokens=4)
    second = client.responses.create(model=MODEL, input="second question", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None
    turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "second question"}]
    # The second prompt is the first turn (without its instructions: they are not carried over) plus the input.
    assert second.usage is not None and second.usage.input_tokens == _count(server, turns)
    third = client.responses.create(model=MODEL, input="third", previous_response_id=second.id,
                                    instructions="Now this", max_output_tokens=2)
    expected = [{"role": "system", "content": "Now this"}, *turns,
                {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "third"}]
    assert third.usage is not None and third.usage.input_tokens == _count(server, expected)
    [item] = client.responses.input_items.list(third.id).data  # only its own input, not the chain's
    assert item.content[0].text == "third"  # type: ignore[union-attr]


def test_json_schema_format_with_parse(client: openai.OpenAI) -> None:
    class Pick(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        a: Literal["yes", "no"]  # an enum: the grammar ends the tiny model's output at once

    parsed = client.responses.parse(model=MODEL, input="choose", text_format=Pick, max_output_tokens=64)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Pick)
    assert parsed.text is not None and parsed.text.format is not None and parsed.text.format.type == "json_schema"
    plain = client.responses.create(model=MODEL, input="choose", text=PICK_FORMAT,  # type: ignore[arg-type]
                                    max_output_tokens=64)
    assert json.loads(plain.output_text)["a"] in ("yes", "no")


def test_another_tenant_sees_nothing(client: openai.OpenAI, server: Server) -> None:
    mine = client.responses.create(model=MODEL, input="private", max_output_tokens=2)
    _, key = make_tenant(server, "responses-other")
    other = _client(server, key)
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                 lambda: other.responses.input_items.list(mine.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{mine.id}' not found."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    assert client.responses.retrieve(mine.id).id == mine.id  # the owner still has it


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=2)
    assert e.value.code == "previous_response_not_found"


@pytest.mark.parametrize("method,path,body,status,param", [
    ("POST", "", {"input": "x", "seed": 3}, 400, "seed"),
    ("POST", "", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     400, "tools[0].parameters"),
    ("POST", "", {"input": "x", "tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
    ("POST", "", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                  "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice"),
    ("POST", "", {"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input[0].call_id"),
    ("POST", "", {"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include[0]"),
    ("POST", "", {"input": "x", "max_output_tokens": 10_000}, 400, "max_output_tokens"),
    ("POST", "", {}, 400, "input"),
    ("POST", "", {"input": "x", "model": "nope"}, 404, "model"),
    ("GET", "/resp_x?stream=true", None, 400, "stream"),
    ("GET", "/resp_x/input_items?limit=0", None, 400, "limit"),
    ("GET", "/resp_x/input_items?order=up", None, 400, "order"),
])
def test_refusals_over_http(server: Server, method: str, path: str, body: dict[str, Any] | None, status: int,
                            param: str) -> None:
    r = httpx.request(method, f"{server.url}/v1/responses{path}", headers=server.headers, timeout=30,
                      json=None if body is None else {"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_usage_goes_to_the_ledger(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=MODEL, input="bill me", max_output_tokens=3)
    assert r.usage is not None
    with store_of(server) as store:
        [row] = [row for row in store.usage_rows("demo") if row.request_id == r.id]
    assert (row.prompt_tokens, row.completion_tokens) == (r.usage.input_tokens, r.usage.output_tokens)


def test_disconnect_cancels_the_stream(server: Server) -> None:
    # Greedy: the tiny model never samples its EOS on this prompt, so only the disconnect can end it early.
    body = {"model": MODEL, "input": "a long story", "max_output_tokens": 3000, "temperature": 0, "stream": True}
    response_id = ""
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{server.url}/v1/responses", json=body,
                                                  headers=server.headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"response.created"' in line:
                response_id = json.loads(line[6:])["response"]["id"]
            if '"response.output_text.delta"' in line:
                break
    wait_idle(server, within=2.0)  # the gateway aborted it and the worker freed its blocks

    def row_status() -> str | None:
        with store_of(server) as store:
            return next((row.status for row in store.usage_rows("demo") if row.request_id == response_id), None)

    assert wait_until(row_status, within=10.0, what="the cancelled request's ledger row") == "cancelled"
    assert httpx.get(f"{server.url}/v1/responses/{response_id}", headers=server.headers).status_code == 404
