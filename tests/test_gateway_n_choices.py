"""``n`` and ``best_of``: several sequences of one prompt, fanned out at the gateway (one worker request each).

Units (no server): parsing and caps, seed derivation, best_of ranking and the usage aggregates, admission of
``prompt + sequences x max_tokens``, and ``follow_all``'s structured concurrency (one failure ends every sequence,
a finished sequence is released at once). Over HTTP (``kvgate serve`` on the tiny model): choices and usage on
both routes, streamed and not, seeds choice by choice, best_of's ranking checked against the logprobs the same
sequences return, the official SDK accumulating a stream by index, refusals in OpenAI's shape, the ledger row, the
vLLM metrics, a tenant's tokens-per-minute seeing n x max_tokens, and a disconnect freeing every sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import trio

from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed, RequestHandle
from gateway.pipeline.admission import QuotaGate
from gateway.pipeline.choices import Child, Choices, child_sampling, child_seed
from gateway.pipeline.generation import Delta, OutputAssembler
from gateway.pipeline.protocol import MAX_N, parse_chat, parse_completion
from gateway.pipeline.streaming import follow_all
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from ipc.messages import RequestOutputMsg
from ipc.sampling import SamplingParams
from tenancy.limiter import Limiter, Scope
from tenancy.models import Quota
from tests.tenancy_support import make_tenant, store_of
from tests.test_gateway_support import MODEL, Server, metric_sum, metrics, send_raw, wait_idle
from tests.test_gateway_units import _FakeTok
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Tell me a story"}]


# ---- units -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_parse_n_and_best_of(tok: GatewayTokenizer) -> None:
    chat = parse_chat({"model": "m", "messages": MSG, "n": 3}, tok, 4096)
    assert (chat.n, chat.best_of) == (3, 3)
    comp = parse_completion({"model": "m", "prompt": "a", "n": 2, "best_of": 4}, tok, 4096)
    assert (comp.n, comp.best_of) == (2, 4)
    # best_of ranks by the sampled tokens' logprobs: the worker sends them though the client did not ask
    assert comp.sampling.logprobs == 0 and not comp.logprobs
    asked = parse_completion({"model": "m", "prompt": "a", "best_of": 3, "logprobs": 2}, tok, 4096)
    assert asked.sampling.logprobs == 2 and asked.logprobs and asked.top_logprobs == 2
    plain = parse_completion({"model": "m", "prompt": "a", "n": 3}, tok, 4096)
    assert plain.sampling.logprobs is None  # nothing to rank: no logprobs asked of the worker
    streamed = parse_completion({"model": "m", "prompt": "a", "n": 2, "best_of": 2, "stream": True}, tok, 4096)
    assert streamed.best_of == 2  # best_of == n has nothing to rank: it may stream


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"), ({"n": -1}, "n"), ({"n": MAX_N + 1}, "n"), ({"best_of": MAX_N + 1}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"), ({"best_of": 0}, "best_of"),
])
def test_parse_refuses_bad_counts(tok: GatewayTokenizer, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "a", **body}, tok, 4096)
    assert e.value.status == 400 and e.value.param == param


def test_chat_has_no_best_of(tok: GatewayTokenizer) -> None:
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": MSG, "best_of": 2}, tok, 4096)
    assert e.value.param == "best_of" and e.value.code == "unrecognized_argument"


def test_child_seeds() -> None:
    base = SamplingParams(temperature=0.7, seed=10, max_tokens=5)
    assert [child_sampling(base, i).seed for i in range(3)] == [10, 11, 12]
    assert child_sampling(base, 2).temperature == 0.7 and child_sampling(base, 2).max_tokens == 5
    assert child_seed(2**63 - 1, 2) == 1  # wraps inside the wire's range
    assert child_sampling(SamplingParams(), 3).seed is None  # unseeded sequences draw from the shared generator


class _Pool:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, handle: RequestHandle) -> None:
        if not handle.released:
            handle.released = True
            self.released.append(handle.request_id)


def _lp_out(rid: str, ids: list[int], lps: list[float], finish: str | None = None,
            cached: int = 0) -> RequestOutputMsg:
    return RequestOutputMsg(rid, ids, finish, cached, [(lp, []) for lp in lps], None, None)


def _choices(n: int, best_of: int) -> tuple[Choices, _Pool]:
    pool = _Pool()
    choices = Choices(pool, "cmpl-x", n, best_of)
    for i in range(best_of):
        asm = OutputAssembler(_FakeTok(), (), False, i)  # type: ignore[arg-type]
        choices.children.append(Child(RequestHandle(choices.child_id(i), "w0", 3), asm))
    return choices, pool


@pytest.mark.trio  # RequestHandle reads Trio's clock
async def test_best_of_ranks_by_cumulative_logprob_and_usage_sums_all() -> None:
    choices, _ = _choices(n=2, best_of=4)
    cumulative = [-3.0, -1.0, -2.0, -1.0]  # the two -1.0 tie: generation order decides
    for child, total in zip(choices.children, cumulative):
        child.asm.add(_lp_out(child.handle.request_id, [97, 98], [total / 2, total / 2], "length",
                              cached=2 + child.asm.index))
    assert [a.index for a in choices.returned()] == [1, 3]
    assert choices.completion_tokens == 8 and choices.cached_tokens == 2
    assert [c.handle.request_id for c in choices.children] == [f"cmpl-x-{i}" for i in range(4)]
    assert Choices(_Pool(), "cmpl-y").child_id(0) == "cmpl-y"  # one sequence: the worker sees the client's id


def test_stop_string_cut_tokens_do_not_count_toward_the_ranking() -> None:
    asm = OutputAssembler(_FakeTok(), ("b",), False)  # type: ignore[arg-type]
    asm.add(_lp_out("r", [97, 98, 99], [-1.0, -2.0, -4.0]))
    assert asm.finish_reason == "stop" and asm.cumulative_logprob == -3.0  # "c" came after the stop string


@pytest.mark.trio
async def test_one_failing_sequence_ends_them_all() -> None:
    choices, _ = _choices(n=3, best_of=3)
    seen: list[Delta] = []

    async def emit(_: Child, d: Delta) -> None:
        seen.append(d)

    choices.children[0].handle.push(_lp_out("cmpl-x-0", [97], [-1.0]))
    choices.children[1].handle.fail("worker_died", "the worker died")
    with trio.fail_after(5), pytest.raises(RequestFailed) as e:
        await follow_all(choices, emit)  # sequences 0 and 2 would wait forever: they must be cancelled
    assert e.value.code == "worker_died" and [d.text for d in seen] in ([], ["a"])  # Trio may run either first


@pytest.mark.trio
async def test_a_finished_sequence_is_released_while_its_siblings_run() -> None:
    choices, pool = _choices(n=2, best_of=2)
    first, second = choices.children

    async def emit(child: Child, d: Delta) -> None:
        if child is first and d.finish_reason is not None:
            assert pool.released == [first.handle.request_id]  # before its last chunk goes out
            second.handle.push(_lp_out(second.handle.request_id, [98], [-1.0], "stop"))

    first.handle.push(_lp_out(first.handle.request_id, [97], [-1.0], "stop"))
    with trio.fail_after(5):
        await follow_all(choices, emit)
    assert pool.released == [first.handle.request_id, second.handle.request_id] and choices.finished


@pytest.mark.trio
async def test_admission_reserves_every_sequence() -> None:
    gate = QuotaGate(Limiter(trio.current_time))
    who: Any = SimpleNamespace(scopes=(Scope("tenant:t", Quota(tpm=100, max_tokens_per_request=50)),))
    with pytest.raises(APIError) as e:  # 10 + 3 x 40 = 130 > 100: can never fit
        await gate.admit(who, "r1", 10, 40, sequences=3)
    assert e.value.status == 400 and e.value.code == "exceeds_quota_limit" and "3 sequences" in e.value.message
    headers = await gate.admit(who, "r2", 10, 40, sequences=2)  # 90: fits; 40 <= 50 per sequence
    assert headers["x-ratelimit-remaining-tokens"] == "10"
    with pytest.raises(APIError) as e:  # the per-request bound applies to each sequence's max_tokens
        await gate.admit(who, "r3", 1, 60, sequences=2)
    assert e.value.code == "exceeds_quota_limit" and "max_tokens 60" in e.value.message


# ---- over HTTP -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(fp32_server: Server) -> Server:
    """The session's fp32 server (choice i is compared with a request of its own, in another batch); its 2 ms steps
    make the disconnect test's long sequences outlive the 0.5 s stats interval on any machine."""
    return fp32_server


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60) as c:
        yield c  # closed after: an idle keep-alive connection holds a gateway's graceful shutdown for 5 s


def _post(server: Server, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=120)


def _ok(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _texts(body: dict[str, Any]) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]


def _stream(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, **body, "stream": True},
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


SAMPLED = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}


@pytest.mark.parametrize("path,prompt", [(CHAT, {"messages": MSG}), (COMP, {"prompt": "Once upon a time"})])
def test_n_choices_usage_and_seeds(server: Server, path: str, prompt: dict[str, Any]) -> None:
    one = _ok(server, path, {**prompt, **SAMPLED, "seed": 7})
    three = _ok(server, path, {**prompt, **SAMPLED, "seed": 7, "n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in three["choices"])
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counts once
    assert three["usage"]["completion_tokens"] == 3 * 6
    assert three["usage"]["total_tokens"] == three["usage"]["prompt_tokens"] + 18
    # seeded: reproducible choice by choice, and choice i is the n=1 request with seed 7 + i
    assert _texts(_ok(server, path, {**prompt, **SAMPLED, "seed": 7, "n": 3})) == _texts(three)
    singles = [_texts(_ok(server, path, {**prompt, **SAMPLED, "seed": 7 + i}))[0] for i in range(3)]
    assert _texts(three) == singles and _texts(one)[0] == singles[0]
    assert len(set(_texts(_ok(server, path, {**prompt, **SAMPLED, "n": 3})))) > 1  # unseeded: they differ
    greedy = _ok(server, path, {**prompt, **SAMPLED, "temperature": 0, "n": 2})
    assert _texts(greedy)[0] == _texts(greedy)[1]


@pytest.mark.parametrize("path,prompt", [(CHAT, {"messages": MSG}), (COMP, {"prompt": "Once upon a time"})])
def test_n_streamed_interleaves_by_index(server: Server, path: str, prompt: dict[str, Any]) -> None:
    body = {**prompt, **SAMPLED, "seed": 11, "n": 3}
    plain = _ok(server, path, body)
    chunks = _stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    *deltas, last = chunks
    assert last["choices"] == [] and last["usage"] == plain["usage"]  # usage once, at the end
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in deltas)
    texts, finishes, roles = ["", "", ""], [[], [], []], [0, 0, 0]
    for c in deltas:
        choice = c["choices"][0]
        i = choice["index"]
        delta = choice.get("delta", {})
        roles[i] += delta.get("role") == "assistant"
        texts[i] += delta.get("content") or choice.get("text") or ""
        if choice["finish_reason"] is not None:
            finishes[i].append(choice["finish_reason"])
    assert texts == _texts(plain) and finishes == [["length"]] * 3
    assert roles == ([1, 1, 1] if path == CHAT else [0, 0, 0])


def test_openai_sdk_streams_two_choices(client: openai.OpenAI, server: Server) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MSG, n=2, max_tokens=5, temperature=1.0,  # type: ignore[arg-type]
                                            seed=3, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert sorted(texts) == [0, 1] and finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 10
    plain = client.chat.completions.create(model=MODEL, messages=MSG, n=2, max_tokens=5, temperature=1.0,  # type: ignore[arg-type]
                                           seed=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in plain.choices] == [texts[0], texts[1]]


def test_best_of_returns_the_most_likely(server: Server) -> None:
    base = {"prompt": "The weather today", "temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "seed": 21}
    every = _ok(server, COMP, {**base, "n": 3, "logprobs": 0})  # best_of == n: all three, generation order
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    ranked = sorted(range(3), key=lambda i: sums[i], reverse=True)
    best = _ok(server, COMP, {**base, "best_of": 3, "logprobs": 0})
    assert len(best["choices"]) == 1 and best["choices"][0]["index"] == 0
    assert best["choices"][0]["text"] == every["choices"][ranked[0]]["text"]
    assert sum(best["choices"][0]["logprobs"]["token_logprobs"]) == pytest.approx(max(sums))
    assert best["usage"]["completion_tokens"] == 18  # every sequence generated is billed
    top2 = _ok(server, COMP, {**base, "n": 2, "best_of": 3})
    assert _texts(top2) == [every["choices"][i]["text"] for i in ranked[:2]]
    assert all(c["logprobs"] is None for c in top2["choices"])  # ranked on logprobs the client did not ask for


@pytest.mark.parametrize("path,body,param", [
    (COMP, {"prompt": "a", "best_of": 2, "stream": True}, "best_of"),
    (COMP, {"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    (CHAT, {"messages": MSG, "n": MAX_N + 1}, "n"),
    (COMP, {"prompt": "a", "n": 0}, "n"),
    (CHAT, {"messages": MSG, "best_of": 2}, "best_of"),
])
def test_refusals_in_openai_shape(server: Server, path: str, body: dict[str, Any], param: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_ledger_and_metrics_count_the_prompt_once(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    r = _ok(server, COMP, {"prompt": "Ledger rows", "n": 4, "max_tokens": 3, "ignore_eos": True})
    with store_of(server) as store:
        [row] = [row for row in store.usage_rows("demo") if row.request_id == r["id"]]
    assert row.prompt_tokens == r["usage"]["prompt_tokens"] and row.completion_tokens == 12
    after = httpx.get(f"{server.url}/metrics").text
    assert metric_sum(after, "vllm:request_params_n_sum") - metric_sum(before, "vllm:request_params_n_sum") == 4
    assert metric_sum(after, "vllm:request_params_best_of_count") > metric_sum(
        before, "vllm:request_params_best_of_count")


def test_tokens_per_minute_sees_every_sequence(server: Server) -> None:
    _, key = make_tenant(server, "n-tpm", quota=Quota(tpm=200, max_tokens_per_request=60))
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    refused = _post(server, COMP, {**body, "n": 4}, key)  # 4 + 4 x 60 > 200: can never fit
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "exceeds_quota_limit", refused.text
    ok = _post(server, COMP, {**body, "n": 3, "max_tokens": 2}, key)  # 60 per sequence is fine; 3 x 2 is used
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 6


def test_structured_output_applies_to_every_choice(server: Server) -> None:
    body = {"messages": MSG, "temperature": 1.0, "max_tokens": 8, "guided_choice": ["yes", "no"]}
    # The worker's first grammar builds its vocabulary index, which may outlast the worker's compile bound on a
    # loaded machine (a 400 that is the worker's business, tested with it): warm it with one sequence first.
    _post(server, CHAT, body)
    r = _ok(server, CHAT, {**body, "n": 3})
    assert all(t in ("yes", "no") for t in _texts(r)), _texts(r)


def _wait_running(server: Server, n: int) -> None:
    # Stats arrive every 0.5 s: the first may predate the request.
    wait_until(lambda: metrics(server), lambda m: m[0] == n and m[1] > 0, within=5.0,
               what=f"{n} sequences running on the worker")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_every_sequence(server: Server, stream: bool) -> None:
    body = {"model": MODEL, "prompt": list(range(1, 801)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "n": 3, "stream": stream}
    wait_idle(server, within=30.0)  # the server is shared: what earlier modules left running ends first
    if stream:
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{server.url}{COMP}", json=body,
                                                      headers=server.headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            _wait_running(server, 3)
    else:
        with send_raw(server, COMP, body):
            _wait_running(server, 3)
    wait_idle(server, within=1.0)  # the gateway aborted all three and the worker freed their blocks


def test_openapi_states_the_caps() -> None:
    from gateway.api.openapi import document

    paths = document()["paths"]
    for path, fields in ((CHAT, ("n",)), (COMP, ("n", "best_of"))):
        props = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        for field in fields:
            assert (props[field]["minimum"], props[field]["maximum"]) == (1, MAX_N), (path, field)
    chat = paths[CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "best_of" not in chat
