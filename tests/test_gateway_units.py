"""Gateway pieces without HTTP or workers: torch-free imports, request validation, stop strings, routing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import AdmissionConfig
from gateway.base.errors import APIError
from gateway.pipeline.generation import OutputAssembler
from gateway.pipeline.protocol import parse_chat, parse_completion
from gateway.fleet.routing import Router, TenantCounts, WorkerLoad, prefix_keys
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from ipc.messages import RequestOutputMsg

REPO = Path(__file__).resolve().parents[1]


GATEWAY_FORBIDDEN = ("workers", "torch", "cupy", "transformers")


def test_gateway_never_imports_workers_torch_or_cupy() -> None:
    """The gateway talks to workers only over IPC: its import graph (app, server, CLI, supervisor, every
    route module) holds nothing from workers/, torch, CuPy or transformers, checked in a fresh interpreter."""
    code = ("import sys, gateway.api.app, gateway.server, gateway.cli, gateway.fleet.supervisor, gateway.__main__; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {GATEWAY_FORBIDDEN!r}); "
            "assert not bad, bad; assert 'gateway.api.app' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_common_imports_neither_side() -> None:
    """common/ is what both sides import, so it may import neither (nor torch)."""
    code = ("import sys, common.detokenizer, common.logs, common.model_files, common.startup; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('gateway', 'workers', 'torch', 'cupy', "
            "'transformers')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))  # converted once; only the tokenizer is read


class _FakeTok:
    """Each token id is one character, so stop-string tests can spell text exactly."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _out(text: str, finish: str | None = None) -> RequestOutputMsg:
    return RequestOutputMsg("r", [ord(c) for c in text], finish, 0, None, None, None)


def test_chat_template_matches_transformers(tok: GatewayTokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok.directory)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(conv) == hf.encode(text, add_special_tokens=False)


def test_openai_routing_fields_are_kept(tok: GatewayTokenizer) -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "prompt_cache_key": "conv-7",
                      "service_tier": "flex"}, tok, 4096)
    assert (req.prompt_cache_key, req.service_tier) == ("conv-7", "flex")


def test_parse_chat_fields(tok: GatewayTokenizer) -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                      "stop": "x", "top_k": 5, "seed": 3, "max_completion_tokens": 7, "user": None}, tok, 4096)
    assert req.max_tokens == 7 and req.stop == ("x",) and req.sampling.top_k == 5
    assert req.sampling.seed == 3 and req.sampling.logprobs is None
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}]}, tok, 100)
    assert req.max_tokens == 100 - len(req.prompt_ids)  # chat default: the rest of the context


def test_chat_store_false_is_served_and_store_true_refused(tok: GatewayTokenizer) -> None:
    """SDKs and frameworks send OpenAI's `store` (false by default) on chat completions; nothing is stored here."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    assert parse_chat({**chat, "store": False}, tok, 4096).prompt_ids == parse_chat(chat, tok, 4096).prompt_ids
    with pytest.raises(APIError) as e:
        parse_chat({**chat, "store": True}, tok, 4096)
    assert (e.value.status, e.value.param, e.value.code) == (400, "store", "unsupported_value")
    assert "/v1/responses" in e.value.message
    with pytest.raises(APIError) as e:
        parse_chat({**chat, "store": "yes"}, tok, 4096)
    assert e.value.param == "store"


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"model": "m", "prompt": "a", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"model": "m", "prompt": "a", "best_of": 2, "stream": True}, "best_of"),
    ({"model": "m", "prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    ({"model": "m", "prompt": "a", "n": 17}, "n"),
    ({"model": "m", "prompt": "a", "echo": "yes"}, "echo"),
    ({"model": "m", "prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": "m", "prompt": "a", "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"model": "m", "prompt": [[1], "a", 3]}, "prompt"),  # a list of prompts holds strings or id arrays only
    ({"model": "m", "prompt": "a", "prompt_cache_key": ""}, "prompt_cache_key"),
    ({"model": "m", "prompt": "a", "prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ({"model": "m", "prompt": "a", "service_tier": "scale"}, "service_tier"),
])
def test_parse_completion_rejects(tok: GatewayTokenizer, body: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body, tok, 4096)
    assert e.value.status == 400 and e.value.param == param


def test_stop_string_never_leaks_across_outputs() -> None:
    asm = OutputAssembler(_FakeTok(), ("END",), False)  # type: ignore[arg-type]
    sent = [asm.add(_out(piece)).text for piece in ("hello E", "N", "D and more")]
    assert "".join(sent) == "hello " and asm.finish_reason == "stop" and asm.hit_stop_string


def test_stop_string_held_back_text_is_flushed_at_finish() -> None:
    asm = OutputAssembler(_FakeTok(), ("STOP",), False)  # type: ignore[arg-type]
    first = asm.add(_out("abcST"))
    last = asm.add(_out("O", "length"))
    assert first.text + last.text == "abcSTO" and asm.finish_reason == "length" and not asm.hit_stop_string


def test_earliest_of_several_stop_strings_wins() -> None:
    asm = OutputAssembler(_FakeTok(), ("zz", "b"), False)  # type: ignore[arg-type]
    d = asm.add(_out("aazzb"))
    assert d.text == "aa" and d.finish_reason == "stop"


def _held(tenant: str, requests: int, tokens: int) -> TenantCounts:
    counts = TenantCounts()
    for i in range(requests):
        counts.add(tenant, 1.0, tokens if i == 0 else 0)
    return counts


def test_router_least_loaded_affinity_and_admission() -> None:
    r = Router(AdmissionConfig(max_requests=2, max_prompt_tokens=1000, affinity_slack=1))
    prompt = list(range(300))
    keys = prefix_keys("salt", prompt)
    assert len(keys) == 2 and prefix_keys("other", prompt) != keys  # salts never share affinity
    loads = [WorkerLoad("a", 1, 10, 0.1), WorkerLoad("b", 0, 0, 0.0)]
    assert r.choose(loads, keys, 300) == "b"  # least loaded
    r.record(keys, "a")
    assert r.choose(loads, keys, 300) == "a"  # the worker that has the prefix, within the slack
    assert r.choose([WorkerLoad("a", 2, 10, 0.1), WorkerLoad("b", 0, 0, 0.0)], keys, 300) == "b"  # a is full
    full = [WorkerLoad("a", 2, 0, 0.0, _held("", 2, 0)), WorkerLoad("b", 1, 900, 0.0, _held("", 1, 900))]
    assert r.choose(full, keys, 300) is None  # one tenant alone never gets past the bounds (routing.py)
    assert r.choose([WorkerLoad("a", 0, 0, 0.0)], [], 5000) == "a"  # a big prompt still fits an idle worker
    r.forget_worker("a")
    assert r.choose(loads, keys, 300) == "b"


@pytest.mark.parametrize("operator", [{}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}])
def test_worker_env_bounds_openmp_spinning_unless_the_operator_chose(
        monkeypatch: pytest.MonkeyPatch, operator: dict[str, str]) -> None:
    from gateway.fleet import supervisor

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(supervisor, "_cpus", lambda: 4)
    for k, v in operator.items():
        monkeypatch.setenv(k, v)

    def waits(workers: int, threads: int | None) -> tuple[str | None, str | None]:
        env = supervisor.worker_env(workers, threads)
        return env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT")

    if operator:  # their setting, alone and unchanged, however many workers
        want = (operator.get("OMP_WAIT_POLICY"), operator.get("GOMP_SPINCOUNT"))
        assert waits(1, None) == want and waits(3, None) == want
        return
    spin, sleep = (None, supervisor.SPIN_COUNT), ("PASSIVE", None)
    assert waits(1, None) == spin  # one worker, a thread per core: spin a bounded while
    assert waits(2, 2) == spin  # 4 threads on 4 CPUs
    assert waits(2, None) == sleep  # 8 threads on 4 CPUs: a spinning thread would hold another's core
    assert waits(3, 2) == sleep
