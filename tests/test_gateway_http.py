"""The gateway over real HTTP: a ``kvgate serve`` subprocess with one real worker on a tiny random model.

Covers the openai SDK (sync/async, stream or not, chat and completions), greedy equality with the offline
engine, stop strings, logprobs, the auxiliary routes, the bad-input table (4xx in OpenAI's shape, never a
5xx) and a client disconnecting mid-stream (the worker frees the request's KV within a second).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.tenancy_support import store_of
from tests.test_gateway_support import MAX_MODEL_LEN, MODEL, Server, metrics, send_raw, wait_idle
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60) as c:
        yield c  # closed after: an idle keep-alive connection holds a gateway's graceful shutdown for 5 s


@pytest.fixture(scope="module")
def offline(tiny_model_dir):  # type: ignore[no-untyped-def]
    from workers import LLM

    return LLM(str(tiny_model_dir), kv_cache_tokens=16384, max_model_len=MAX_MODEL_LEN, quantization="none")


@pytest.fixture(scope="module")
def server(fp32_server: Server) -> Server:
    """The session's fp32 server (tests/test_gateway_support.py): greedy output is compared with the fp32 offline
    engine, and its 2 ms steps make the disconnect tests' 3,000-token requests outlive the 0.5 s stats interval."""
    return fp32_server


def _post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60, **kw)


# ---- openai SDK ---------------------------------------------------------------------------------

def test_sdk_sync_chat_and_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body=GREEDY, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens is not None
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert c.object == "text_completion" and c.usage is not None and c.usage.completion_tokens <= 4
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=GREEDY)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.startswith(r.choices[0].message.content or "") and len(text) > 0
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_sdk_async_stream_and_plain(server: Server) -> None:
    async def main() -> None:
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        plain = await c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        stream = await c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream])
        assert text == plain.choices[0].text
        chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                               max_tokens=3, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        await c.close()

    trio.run(_asyncio_bridge, main)


async def _asyncio_bridge(main: Any) -> None:
    # The openai async client runs on anyio, which supports Trio: run it under Trio directly.
    await main()


def test_greedy_matches_offline_engine(client: openai.OpenAI, offline) -> None:  # type: ignore[no-untyped-def]
    from workers import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = "The quick brown fox"
    ref = offline.generate([prompt], params)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == ref.text
    assert got.choices[0].logprobs is not None
    assert got.choices[0].logprobs.tokens == [offline.tokenizer.decode([t]) for t in ref.token_ids]
    for lp, (ref_lp, _) in zip(got.choices[0].logprobs.token_logprobs or [], ref.logprobs or []):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    ref_chat = offline.chat([conv], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    chat = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=16, temperature=0,  # type: ignore[arg-type]
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == ref_chat.text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ref_chat.prompt_token_ids)


def test_stop_string_truncates_and_frees(server: Server, client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True}, stream=stream)
        if stream:
            chunks = list(r)  # type: ignore[arg-type]
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason  # type: ignore[union-attr]
        assert text == full[:full.index(stop)] and reason == "stop"
    wait_idle(server)


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body=GREEDY)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy picks the top token


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        return client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0, seed=1234,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample() == sample()


# ---- auxiliary routes ---------------------------------------------------------------------------

def test_aux_routes(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    tok = _post(server, "/tokenize", {"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat_tok = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > tok["count"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="{MODEL}",worker="w0"}}' in text
    bad = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"


def test_x_request_id_names_the_response_and_its_ledger_row(server: Server, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])
    body = raw.parse()
    assert raw.headers["x-request-id"] == body.id and body._request_id == body.id  # the SDK reads it too
    plain = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert plain.headers["x-request-id"] == plain.json()["id"]
    with store_of(server) as store:
        assert {body.id, plain.json()["id"]} <= {row.request_id for row in store.usage_rows("demo")}
    assert "x-request-id" not in httpx.get(f"{server.url}/v1/models", headers=server.headers).headers


def test_sse_headers(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=server.headers, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# ---- bad input --------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS: list[tuple[str, str, Any, int]] = [
    ("malformed json", CHAT, b'{"model": "tiny", "messages": [', 400),
    ("not an object", CHAT, b"[1, 2, 3]", 400),
    ("invalid utf-8", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("lone surrogate", COMP, b'{"model": "tiny", "prompt": "\\ud800"}', 400),
    ("NaN constant", COMP, b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400),
    ("missing model", CHAT, {"messages": MSG}, 400),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404),
    ("unknown field", CHAT, {"model": MODEL, "messages": MSG, "frobnicate": 1}, 400),
    ("unsupported tools", CHAT, {"model": MODEL, "messages": MSG, "tools": []}, 400),
    ("wrong type max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": "10"}, 400),
    ("bool as int", COMP, {"model": MODEL, "prompt": "a", "max_tokens": True}, 400),
    ("negative max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400),
    ("zero max_tokens", COMP, {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400),
    ("huge max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 10**12}, 400),
    ("temperature out of range", CHAT, {"model": MODEL, "messages": MSG, "temperature": -1}, 400),
    ("top_p out of range", COMP, {"model": MODEL, "prompt": "a", "top_p": 0}, 400),
    ("n = 0", CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400),
    ("message without role", CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, 400),
    ("image content", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400),
    ("token id out of vocab", COMP, {"model": MODEL, "prompt": [1, 10**9]}, 400),
    ("over-long prompt", COMP, {"model": MODEL, "prompt": list(range(1, MAX_MODEL_LEN + 10))}, 400),
    ("stream_options without stream", CHAT, {"model": MODEL, "messages": MSG,
                                             "stream_options": {"include_usage": True}}, 400),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400),
    ("too many logprobs", COMP, {"model": MODEL, "prompt": "a", "logprobs": 99}, 400),
    ("bad stop", COMP, {"model": MODEL, "prompt": "a", "stop": [1]}, 400),
    ("deep nesting", CHAT, b"[" * 100_000 + b"]" * 100_000, 400),
    ("10 MB body", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * 10_000_000
     + b'"}]}', 413),
]


@pytest.mark.parametrize("name,path,body,status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_4xx_in_openai_shape(server: Server, name: str, path: str, body: Any, status: int) -> None:
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", headers={**server.headers, "Content-Type": "application/json"},
                   timeout=60, **kw)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if name == "unknown field":
        assert err["param"] == "frobnicate" and "frobnicate" in err["message"]
    if name == "huge max_tokens" or name == "over-long prompt":
        assert err["code"] == "context_length_exceeded"


def test_bad_key_and_unknown_route(server: Server) -> None:
    r = httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{server.url}/v1/nope", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.json()["error"]["message"] == "Invalid URL (GET /v1/nope)"  # OpenAI's words for a path it lacks
    r = httpx.post(f"{server.url}/v1/embeddings", headers=server.headers, json={"model": MODEL, "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"


# ---- cancellation -----------------------------------------------------------------------------

def _wait_busy(server: Server) -> None:
    # Stats arrive every 0.5 s: the first may predate the request.
    wait_until(lambda: metrics(server), lambda m: m[0] == 1 and m[1] > 0, within=3.0,
               what="the request running on the worker")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_kv_within_1s(server: Server, stream: bool) -> None:
    body = {"model": MODEL, "prompt": list(range(1, 1001)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=30) as c:
        if stream:
            with c.stream("POST", f"{server.url}{COMP}", json=body, headers=server.headers) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for _ in range(5):
                    next(lines)
                _wait_busy(server)  # really running on the worker when we leave
        else:
            # A raw connection, so the test sees the request running *before* it hangs up (a client timeout
            # raced the gateway: when the abort landed before the next 0.5 s stats frame, busy was never seen).
            with send_raw(server, COMP, body):
                _wait_busy(server)
    # The connection is closed: the gateway must abort the request and the worker free its blocks.
    wait_idle(server, within=1.0)
