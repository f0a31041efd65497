"""OpenAI's ``logit_bias``: token id -> a bias in [-100, 100] added to its logit before sampling (greedy and
random rows alike); the returned logprobs stay the model's. Checked at each boundary: the gateway's parse (a 400
naming the field), the wire type, the worker's engine (an id past the vocabulary is a 4xx for that request, never a
failed step), and over HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest
import torch

from gateway.base.errors import APIError
from gateway.pipeline.protocol import parse_chat, parse_completion
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from ipc.codec import ProtocolError, decode, encode
from ipc.messages import Generate
from ipc.sampling import MAX_LOGIT_BIAS, SamplingParams
from tests.test_gateway_support import MODEL, Server
from tests.tiny import hf_model, tiny_engine
from workers.core.request import Request
from workers.sampler import Sampler

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("bias", [[(-1, 1.0)], [(3, 100.5)], [(3, float("nan"))], [(3, 1.0), (3, 2.0)],
                                  [(True, 1.0)], [(i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)]])
def test_the_wire_type_refuses_bad_biases(bias: Any) -> None:
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=bias)


def test_biases_are_sorted_and_travel_the_wire() -> None:
    p = SamplingParams(logit_bias=((9, -100.0), (2, 5)))  # type: ignore[arg-type]
    assert p.logit_bias == ((2, 5), (9, -100.0)) and p.has_penalties
    msg = decode(encode(Generate("r", [1], p, None, 1.0, None, None)))
    assert isinstance(msg, Generate) and msg.sampling == p
    raw = msgpack.unpackb(encode(Generate("r", [1], SamplingParams(), None, 1.0, None, None)))
    for bias in ([[1]], [[1, "x"]], [["1", 2.0]], 7):  # not a pair, not a number, not an id, not a list
        raw[3][-1] = bias  # [tag, request_id, prompt, sampling, ...]: sampling's last field
        with pytest.raises(ProtocolError):
            decode(msgpack.packb(raw))


def _req(rid: str, **kw: Any) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw), eos_token_ids=frozenset({0}), max_total_tokens=100)


def test_the_sampler_adds_the_bias_and_keeps_the_model_s_logprobs() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(4, torch.device("cpu"))
    plain, up, down = sampler.sample(logits.repeat(3, 1), [
        _req("a", temperature=0.0, logprobs=0), _req("b", temperature=0.0, logprobs=0, logit_bias=[(3, 100.0)]),
        _req("c", temperature=0.0, logprobs=0, logit_bias=[(0, -100.0)])])
    assert (plain.token_id, up.token_id, down.token_id) == (0, 3, 1)
    assert up.logprobs is not None and up.logprobs[0] == pytest.approx(float(torch.log(torch.tensor(0.05))))
    rows = [_req(f"r{i}", temperature=1.0, seed=i, logit_bias=[(0, -100.0), (1, -100.0)]) for i in range(100)]
    assert set(t.token_id for t in sampler.sample(logits.repeat(100, 1), rows)) == {2, 3}


def test_the_engine_refuses_an_id_past_its_vocabulary() -> None:
    engine = tiny_engine(hf_model())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias=((engine.vocab_size, 1.0),)))
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_the_gateway_parses_openai_s_object(tok: GatewayTokenizer) -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                      "logit_bias": {"50": -100, "7": 2.5}}, tok, 4096)
    assert req.sampling.logit_bias == ((7, 2.5), (50, -100.0))


@pytest.mark.parametrize("bias,fragment", [
    ([1, 2], "must be an object"), ({"x": 1}, "is not a token id"), ({"-1": 1}, "is not a token id"),
    ({"99999999": 1}, "is not a token id"), ({"5": 101}, "in [-100, 100]"), ({"5": "1"}, "in [-100, 100]"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
])
def test_the_gateway_refuses_bad_objects(tok: GatewayTokenizer, bias: Any, fragment: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "a", "logit_bias": bias}, tok, 4096)
    assert e.value.status == 400 and e.value.param == "logit_bias" and fragment in e.value.message


@pytest.fixture(scope="module")
def server(fp32_server: Server) -> Server:
    return fp32_server


def _tokens(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                         "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()["choices"][0]["logprobs"]
    return out


def test_over_http_a_bias_steers_greedy_tokens(server: Server, tok: GatewayTokenizer) -> None:
    plain = _tokens(server, {})
    forced = _tokens(server, {"logit_bias": {"42": 100}})
    assert forced["tokens"] == [tok.token_text(42)] * 3
    assert all(lp < 0 for lp in forced["token_logprobs"])  # the model's own logprob of token 42, not 0
    first = tok.encode(plain["tokens"][0]) if plain["tokens"][0] else []
    if len(first) == 1:  # its text is one token: ban it and the first token changes
        banned = _tokens(server, {"logit_bias": {str(first[0]): -100}})
        assert banned["tokens"][0] != plain["tokens"][0]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "logit_bias": {"10000000": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
