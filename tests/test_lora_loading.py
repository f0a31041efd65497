"""Adapters load beside the engine (workers/lora/registry.py): a request for an adapter that is not resident parks
while a thread reads it, and every other request's steps go on meanwhile; an abort while it loads leaves no pin."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import workers.lora.registry as registry
from tests.lora_support import ATTN, lora_engine, make_adapter
from tests.tiny import hf_model
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
HOLD_S = 30.0  # a held load's limit: far beyond any step of the tiny model, however slow the machine


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture
def held_loads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], threading.Event]:
    """Every adapter load waits for the returned event (HOLD_S at most) before reading; the list gets the names
    of the threads that ran the loads."""
    threads: list[str] = []
    go = threading.Event()
    real = registry.load_adapter

    def held(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        go.wait(HOLD_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "load_adapter", held)
    return threads, go


def _step_all(eng: LLMEngine) -> dict[str, tuple[list[int], list[Any]]]:
    out: dict[str, tuple[list[int], list[Any]]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks, lps = out.get(o.request_id, ([], []))
            out[o.request_id] = (toks + o.new_token_ids, lps + list(o.logprobs or []))
    return out


def test_other_requests_step_while_an_adapter_loads(hf: Any, tmp_path: Path,
                                                    held_loads: tuple[list[str], threading.Event]) -> None:
    threads, go = held_loads
    make_adapter(hf, tmp_path / "attn", ATTN, r=8, seed=1)
    eng = lora_engine(hf, tmp_path)
    t0 = time.perf_counter()
    eng.add_request("lora", [5, 6, 7, 8], PARAMS, lora="attn")
    assert time.perf_counter() - t0 < HOLD_S / 2  # add_request did not wait for the (held) load
    eng.add_request("base", [9, 10, 11], PARAMS)
    base: list[int] = []
    for _ in range(10_000):  # the base request runs to its end while the adapter is still loading
        for o in eng.step():
            assert o.request_id == "base", "the LoRA request produced output before its adapter loaded"
            base += o.new_token_ids
            if o.finish_reason is not None:
                break
        else:
            continue
        break
    assert len(base) == 6 and eng.has_unfinished()
    go.set()
    got = _step_all(eng)
    assert threads and all(name.startswith("lora-load") for name in threads)  # never the engine's thread
    assert len(got["lora"][0]) == 6
    # The same request with the adapter already resident: the same bits.
    eng.add_request("again", [5, 6, 7, 8], PARAMS, lora="attn")
    assert _step_all(eng)["again"] == got["lora"]
    assert eng.loras is not None and eng.loras.loads == 1


def test_an_abort_while_loading_leaves_no_pin(hf: Any, tmp_path: Path,
                                              held_loads: tuple[list[str], threading.Event]) -> None:
    _, go = held_loads
    make_adapter(hf, tmp_path / "attn", ATTN, r=8, seed=1)
    eng = lora_engine(hf, tmp_path, max_loras=1, max_cpu_loras=1)
    reg = eng.loras
    assert reg is not None
    eng.add_request("gone", [5, 6, 7], PARAMS, lora="attn")
    eng.abort(["gone"])
    got = _step_all(eng)
    assert got == {"gone": ([], [])}  # finished (aborted) with nothing generated
    assert reg.loading == ["attn"] and reg.pinned == {} and not eng.has_unfinished()
    go.set()
    # The load lands when a request next asks for the adapter; it is read once.
    eng.add_request("next", [5, 6, 7], PARAMS, lora="attn")
    assert len(_step_all(eng)["next"][0]) == 6
    assert reg.resident == ["attn"] and reg.loads == 1 and reg.pinned == {}


def test_a_request_waits_for_both_its_grammar_and_its_adapter(tmp_path: Path,
                                                               held_loads: tuple[list[str], threading.Event]) -> None:
    import json

    from transformers import AutoTokenizer

    from workers import structured
    from workers.model_files import resolve

    _, go = held_loads
    big = hf_model(vocab_size=49152, eos_token_id=2, bos_token_id=1)  # smollm2's tokenizer drives the grammar
    make_adapter(big, tmp_path / "attn", ATTN, r=8, seed=1)
    eng = lora_engine(big, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2").directory)
    outputs = structured.enable(eng, tokenizer)
    outputs.compiled(json.dumps({"type": "choice", "choices": ["warm"]}))  # the tokenizer's one-time load
    spec = json.dumps({"type": "choice", "choices": ["yes", "no"]})  # compiles in its thread, beside the load
    params = SamplingParams(max_tokens=8, temperature=0.0, structured=spec)
    eng.add_request("both", [5, 6, 7], params, lora="attn")
    deadline = time.monotonic() + HOLD_S
    while outputs.compiling("both") or eng.loras is None or not eng.loras.loading:  # the grammar compiles first
        assert eng.step() == [] and time.monotonic() < deadline
    for _ in range(20):  # grammar ready, adapter still held: the request stays parked, nothing is produced
        assert eng.step() == []
    assert eng.has_unfinished() and not outputs.compiling("both")
    go.set()
    got = _step_all(eng)
    text = tokenizer.decode([t for t in got["both"][0] if t != 2])
    assert text in ("yes", "no") and eng.loras is not None and eng.loras.pinned == {}
