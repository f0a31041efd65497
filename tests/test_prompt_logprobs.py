"""The prompt's own logprobs: vLLM's ``prompt_logprobs`` (both routes) and ``echo`` with ``logprobs`` on completions
(what lm-eval-harness's loglikelihood tasks send).

Engine: the logprob the prompt gives token i+1 is the one the model gives it after tokens 0..i, so each position's
top alternatives equal, bit for bit, the first-token logprobs of a request whose prompt stops there (the kernels'
rows do not depend on the batch). Over HTTP (tiny model): the shapes, echo's text and offsets, streamed and not.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from gateway.base.errors import APIError
from gateway.pipeline.protocol import parse_chat, parse_completion
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from tests.test_determinism import _tiny, drain, engine
from tests.test_gateway_support import MODEL, Server
from tests.tiny import VOCAB
from workers.core.sampling_params import SamplingParams


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_prompt_logprobs_are_the_next_token_logprobs_of_each_prefix(mode: str) -> None:
    model, max_len = _tiny(mode)
    prompt = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    eng = engine(model, max_len, mode, batched=16)  # the prompt in chunks of 16: rows from three steps
    eng.add_request("full", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4))
    prefixes = [(f"p{i}", prompt[:i + 1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=4))
                for i in (0, 7, 15, 16, 38)]
    got = drain(eng, prefixes, every=1)
    full = got["full"][2]
    assert len(full) == len(prompt) - 1
    for rid, pre, _ in prefixes:
        i = len(pre) - 1
        lp, rank, top = full[i]
        first_lp, first_top = got[rid][1][0]  # the prefix's first generated token: its argmax
        assert top == first_top, f"position {i}"
        assert rank >= 1 and (rank == 1) == (prompt[i + 1] == top[0][0])
        assert (lp == first_lp) == (prompt[i + 1] == got[rid][0][0])


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_fields_and_refusals(tok: GatewayTokenizer) -> None:
    req = parse_completion({"model": "m", "prompt": "Hello there", "echo": True, "logprobs": 2}, tok, 4096)
    assert req.echo == "Hello there" and req.sampling.prompt_logprobs == 2  # echo + logprobs scores the prompt
    req = parse_completion({"model": "m", "prompt": "Hello", "echo": True}, tok, 4096)
    assert req.echo == "Hello" and req.sampling.prompt_logprobs is None  # text only: nothing to compute
    req = parse_completion({"model": "m", "prompt": [19556], "echo": True, "prompt_logprobs": 5, "logprobs": 1},
                           tok, 4096)
    assert req.echo == tok.decode([19556]) and req.sampling.prompt_logprobs == 5 and req.prompt_logprobs == 5
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}, tok, 4096)
    assert chat.sampling.prompt_logprobs == 0
    for bad in (21, -1):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "x", "prompt_logprobs": bad}, tok, 4096)
        assert e.value.status == 400 and e.value.param == "prompt_logprobs"
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, tok, 4096)
    assert e.value.param == "echo"  # chat has no echo in OpenAI's API


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _stream(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, headers=server.headers, timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_echo_with_logprobs_streamed_and_not(server: Server) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0, "echo": True, "logprobs": 2}
    resp = _post(server, "/v1/completions", body)
    choice, n_prompt = resp["choices"][0], resp["usage"]["prompt_tokens"]
    assert choice["text"].startswith("The capital of France is")
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt + resp["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:n_prompt]) == "The capital of France is"
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][n_prompt] == len(
        "The capital of France is")
    chunks = _stream(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    streamed: dict[str, list[Any]] = {k: [] for k in lp}
    for c in chunks:
        for k, v in (c["choices"][0]["logprobs"] or {}).items():
            streamed[k] += v
    assert streamed == lp
    assert "prompt_logprobs" not in choice  # echo is OpenAI's; vLLM's field only when asked for


def test_prompt_logprobs_shape_on_both_routes(server: Server) -> None:
    comp = _post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "prompt_logprobs": 3})
    plp = comp["choices"][0]["prompt_logprobs"]
    assert len(plp) == comp["usage"]["prompt_tokens"] and plp[0] is None
    for entry in plp[1:]:
        assert 3 <= len(entry) <= 4  # the top 3, and the prompt's token when it is not among them
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
        assert all(isinstance(v["decoded_token"], str) and v["logprob"] <= 0 for v in entry.values())
    again = _post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "prompt_logprobs": 3})
    assert again["choices"][0]["prompt_logprobs"] == plp  # computed again (no cache hit), the same bits
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    chat_body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    chat = _post(server, "/v1/chat/completions", chat_body)
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # only the prompt's own token
    chunks = _stream(server, "/v1/chat/completions", chat_body)
    assert [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c] == [chat["prompt_logprobs"]]


def test_prompt_logprobs_count_against_the_pending_output_bounds() -> None:
    # A 4,000-token prompt's logprobs with 20 alternatives each arrive in one output: they must weigh what they
    # hold, or a stalled reader of many such requests grows the gateway past every stated bound.
    from gateway.base.handle import output_bytes
    from ipc.messages import RequestOutputMsg

    plain = RequestOutputMsg("r", [1], None, 0, None, None, None)
    scored = RequestOutputMsg("r", [1], None, 0, None, None, None, None,
                              [(-1.0, 1, [(t, -1.0) for t in range(20)])] * 4000)
    assert output_bytes(scored) > output_bytes(plain) + 4000 * 20 * 8
