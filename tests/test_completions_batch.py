"""``/v1/completions`` with a list of prompts (OpenAI's and vLLM's batched prompts; LangChain's completions LLM
sends its prompts this way): each prompt gets its ``n`` choices, indexed ``prompt * n + choice``, each exactly what
the prompt alone returns; usage counts every prompt once; echo and logprobs follow each choice's own prompt.

Units: parsing, caps and refusals, and ``Choices`` grouping (ranking within a prompt, cached tokens per prompt).
Over HTTP (the session's fp32 tiny-model server): plain, seeded n > 1, streamed, echo with logprobs, the SDK.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from gateway.base.errors import APIError
from gateway.base.handle import RequestHandle
from gateway.pipeline.choices import Child, Choices
from gateway.pipeline.generation import OutputAssembler
from gateway.pipeline.protocol import MAX_SEQUENCES, parse_completion
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from ipc.messages import RequestOutputMsg
from tests.test_gateway_support import MODEL, Server
from tests.test_gateway_units import _FakeTok

pytestmark = pytest.mark.timeout(240)

COMP = "/v1/completions"
PROMPTS = ["Once upon a time", "The weather today is", "In a hole in the ground there lived"]


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def test_parse_a_list_of_prompts(tok: GatewayTokenizer) -> None:
    req = parse_completion({"model": "m", "prompt": ["a b", [5, 6, 7]], "n": 2, "best_of": 3, "echo": True}, tok,
                           4096)
    assert [p.ids for p in req.prompts()] == [tok.encode("a b"), [5, 6, 7]]
    assert [p.echo for p in req.prompts()] == ["a b", tok.decode([5, 6, 7])]  # ids echo as their text
    assert req.prompt_ids == tok.encode("a b") and req.echo == "a b"  # the first prompt, as for one
    assert req.prompt_tokens == len(tok.encode("a b")) + 3 and req.sequences == 6
    one = parse_completion({"model": "m", "prompt": ["a b"]}, tok, 4096)
    assert one.batch == () and one.prompts()[0].ids == tok.encode("a b") and one.sequences == 1


@pytest.mark.parametrize("prompt,message", [
    (["a", 5], "must be a string, an array of token ids, or an array of either"),
    (["a", []], "'prompt[1]' must not be empty"),
    ([], "'prompt' must not be empty"),
    (["a"] * (MAX_SEQUENCES + 1), f"at most {MAX_SEQUENCES} are allowed"),
    ([[1, 2], [3, 10**9]], "outside [0,"),
])
def test_parse_refuses_bad_lists(tok: GatewayTokenizer, prompt: Any, message: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": prompt}, tok, 4096)
    assert e.value.status == 400 and e.value.param == "prompt" and message in e.value.message


def test_parse_caps_sequences_and_checks_the_longest_prompt(tok: GatewayTokenizer) -> None:
    with pytest.raises(APIError) as e:  # 5 prompts x best_of 16 = 80 sequences
        parse_completion({"model": "m", "prompt": ["a"] * 5, "best_of": 16}, tok, 4096)
    assert e.value.status == 400 and "80" in e.value.message
    with pytest.raises(APIError) as e:  # fits the short prompt, not the long one
        parse_completion({"model": "m", "prompt": [[1] * 10, [1] * 90], "max_tokens": 20}, tok, 100)
    assert e.value.code == "context_length_exceeded" and "90 in the prompt" in e.value.message


class _Pool:
    def release(self, handle: RequestHandle) -> None:
        handle.released = True


@pytest.mark.trio  # RequestHandle reads Trio's clock
async def test_choices_rank_within_each_prompt_and_count_cached_tokens_per_prompt() -> None:
    choices = Choices(_Pool(), "cmpl-b", n=1, best_of=2, prompts=2)
    for k in range(4):
        asm = OutputAssembler(_FakeTok(), (), False, k)  # type: ignore[arg-type]
        choices.children.append(Child(RequestHandle(choices.child_id(k), "w0", 3), asm))
    # prompt 0: sequences -3 and -1 (the second wins); prompt 1: -1 and -2 (the first wins)
    for child, total, cached in zip(choices.children, [-3.0, -1.0, -1.0, -2.0], [4, 6, 0, 8]):
        child.asm.add(RequestOutputMsg(child.handle.request_id, [97, 98], "length", cached,
                                       [(total / 2, []), (total / 2, [])], None, None))
    assert [a.index for a in choices.returned()] == [1, 2] and choices.num_returned == 2
    assert choices.cached_tokens == 4 + 0 and choices.completion_tokens == 8
    assert [c.handle.request_id for c in choices.children] == [f"cmpl-b-{k}" for k in range(4)]


# ---- over HTTP -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(fp32_server: Server) -> Server:
    return fp32_server


def _ok(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}{COMP}", json={"model": MODEL, **body}, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


SAMPLED = {"temperature": 1.0, "max_tokens": 5, "ignore_eos": True, "seed": 5}


def test_each_choice_is_what_its_prompt_returns_alone(server: Server) -> None:
    both = _ok(server, {"prompt": PROMPTS, **SAMPLED, "n": 2})
    assert [c["index"] for c in both["choices"]] == list(range(6))
    singles = [_ok(server, {"prompt": p, **SAMPLED, "n": 2}) for p in PROMPTS]
    assert [c["text"] for c in both["choices"]] == [c["text"] for s in singles for c in s["choices"]]
    assert both["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert both["usage"]["completion_tokens"] == 6 * 5
    greedy = _ok(server, {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "temperature": 0})
    alone = [_ok(server, {"prompt": p, "max_tokens": 4, "temperature": 0}) for p in ([5, 6, 7], [8, 9])]
    assert [c["text"] for c in greedy["choices"]] == [a["choices"][0]["text"] for a in alone]


def test_streamed_by_index_equals_the_whole(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[:2], **SAMPLED, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}{COMP}", json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    *deltas, last = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in deltas:
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    whole = _ok(server, {"prompt": PROMPTS[:2], **SAMPLED, "n": 2})
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert finishes == {i: "length" for i in range(4)} and last["usage"] == whole["usage"]


def test_echo_and_logprobs_follow_each_choice_s_prompt(server: Server, tok: GatewayTokenizer) -> None:
    out = _ok(server, {"prompt": PROMPTS[:2], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
                       "ignore_eos": True})
    for prompt, choice in zip(PROMPTS[:2], out["choices"]):
        k = len(tok.encode(prompt))
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert "".join(lp["tokens"][:k]) == prompt and len(lp["tokens"]) == k + 3
        assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])] and lp["text_offset"][k] == len(prompt)


def test_the_sdk_sends_a_list_of_prompts(server: Server) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=60) as c:
        r = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 9


def test_the_router_says_what_idle_workers_could_never_hold() -> None:
    from gateway.config import AdmissionConfig
    from gateway.fleet.routing import Router

    router = Router(AdmissionConfig(max_requests=4, max_prompt_tokens=1000))
    assert router.never_admits(1, 4, 1000, 250, 1.0) is None
    assert "5 sequences" in (router.never_admits(1, 5, 10, 2, 1.0) or "")
    assert router.never_admits(2, 5, 10, 2, 1.0) is None  # two workers admit 8
    assert "admit 2 at once" in (router.never_admits(1, 3, 10, 2, 0.5) or "")  # a tier with half the bounds
    assert "1001 prompt tokens" in (router.never_admits(1, 2, 1001, 600, 1.0) or "")
    assert router.never_admits(2, 2, 4000, 2000, 1.0) is None  # each idle worker takes one prompt past the bound
    assert router.never_admits(1, 1, 50_000, 50_000, 0.5) is None  # one sequence always fits an idle worker


def test_the_refusal_names_the_one_request_an_idle_worker_always_admits() -> None:
    from gateway.config import AdmissionConfig
    from gateway.fleet.routing import Router

    # a batch tier's half of a 1-request bound is under one, but an idle worker still takes one request
    why = Router(AdmissionConfig(max_requests=1, max_prompt_tokens=1000)).never_admits(1, 2, 10, 5, 0.5)
    assert why is not None and "admit 1 at once" in why
