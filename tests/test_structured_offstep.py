"""Grammar compiles off the engine's critical path (issue 24, item 3): a structured request waits for its
compile outside the scheduler while the other requests' steps go on; a compile past its bound is refused with
the reason and does not hold the compile threads forever; a parked request can be aborted; an engine (and a
worker loop) with only parked requests waits instead of spinning.

Compiles are made slow on purpose (``grammar_for`` blocks until the test opens a gate) and the bound runs on a
fake clock, so nothing here depends on how fast the machine is: the tests count steps and tokens, not ms."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest

from ipc.messages import Generate, GatewayToWorker, RequestError, StepOutputs
from tests.tiny import hf_model, run_all, tiny_engine
from workers import structured
from workers.core.outputs import StepOutput
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.grammar_compile import MAX_OVERDUE
from workers.structured import COMPILE_THREADS, IDLE_POLL_S
from workers.process.worker import Worker
from workers.process.worker_io import EngineSnapshot, StepClock, StopRequest

EOS = 2  # smollm2's <|im_end|>
HANG = "hang-"  # a spec containing this compiles only once the test's gate is open
BOUND_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from workers.model_files import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2").directory)


@pytest.fixture
def compiled_specs(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[tuple[str, str]]]]:
    """(the gate, [(spec, thread name)] of every compile begun): a HANG spec's compile waits for the gate."""
    gate = threading.Event()
    begun: list[tuple[str, str]] = []
    real = structured.grammar_for

    def gated(spec_text: str) -> str:
        begun.append((spec_text, threading.current_thread().name))
        if HANG in spec_text:
            gate.wait(120)  # never forever: a failing test must not leave a thread behind for good
        return real(spec_text)

    monkeypatch.setattr(structured, "grammar_for", gated)
    yield gate, begun
    gate.set()


def _engine(tokenizer: Any, clock: FakeClock) -> LLMEngine:
    eng = tiny_engine(hf_model(vocab_size=49152, eos_token_id=EOS, bos_token_id=1), max_num_batched_tokens=256)
    outputs = structured.enable(eng, tokenizer, compile_timeout_s=BOUND_S, clock=clock)
    outputs.compiled(_choice("warm-up"))  # the tokenizer is loaded by the first compile: not during the test
    return eng


def _choice(*choices: str) -> str:
    return json.dumps({"type": "choice", "choices": list(choices)})


def _shaped(spec: str, seed: int = 5, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec)


def _plain(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _step_until(eng: LLMEngine, done: Callable[[dict[str, list[StepOutput]]], bool],
                wall_s: float = 120.0) -> dict[str, list[StepOutput]]:
    """Step (the fake clock stands still) until ``done(outputs so far)``; a real compile has ``wall_s``."""
    outs: dict[str, list[StepOutput]] = {}
    end = time.monotonic() + wall_s
    while not done(outs):
        if time.monotonic() > end:
            raise AssertionError(f"not done after {wall_s} s: {outs}")
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _finished(*rids: str) -> Callable[[dict[str, list[StepOutput]]], bool]:
    return lambda outs: all(rid in outs and outs[rid][-1].finished for rid in rids)


def _text(tokenizer: Any, outs: list[StepOutput]) -> str:
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids and ids[-1] == EOS and outs[-1].error is None
    return str(tokenizer.decode(ids[:-1]))


def test_other_requests_step_on_while_a_grammar_compiles(tokenizer: Any, compiled_specs: Any) -> None:
    gate, begun = compiled_specs
    eng = _engine(tokenizer, FakeClock())
    eng.add_request("plain", [1, 5, 6], _plain(40))
    t0 = time.monotonic()
    eng.add_request("shaped", [1, 7, 8], _shaped(_choice("hang-a", "hang-b")))
    assert time.monotonic() - t0 < 1.0  # it used to wait for the compile here (up to the 5 s bound)
    plain: list[int] = []
    for _ in range(25):  # the compile is held all along
        for o in eng.step():
            assert o.request_id == "plain"
            plain += o.new_token_ids
    assert len(plain) == 25  # a token at every step
    assert eng.has_unfinished() and eng.stats().num_waiting == 1

    gate.set()
    out = run_all(eng)
    # every compile ran beside the engine thread, never in it
    assert {name for _, name in begun} == {"grammar-compile"} and len(begun) == 2
    shaped_ids = out["shaped"]
    assert shaped_ids[-1] == EOS and tokenizer.decode(shaped_ids[:-1]) in ("hang-a", "hang-b")
    eng.add_request("alone", [1, 5, 6], _plain(40))
    assert plain + out["plain"] == run_all(eng)["alone"]  # the plain request never noticed
    # A compile that finished late changes when a request starts, never its tokens: the same seeded request
    # again, now from the cache (scheduled at once), samples the same tokens.
    eng.add_request("again", [1, 7, 8], _shaped(_choice("hang-a", "hang-b")))
    assert eng.structured is not None and eng.structured.num_waiting == 0
    assert run_all(eng)["again"] == shaped_ids


def test_requests_with_one_spec_share_one_compile(tokenizer: Any, compiled_specs: Any) -> None:
    gate, begun = compiled_specs
    eng = _engine(tokenizer, FakeClock())
    spec = _choice("hang-s", "hang-t")
    rids = [f"s{i}" for i in range(8)]
    for i, rid in enumerate(rids):
        eng.add_request(rid, [1, 2, 3 + i], _shaped(spec, seed=i))
    assert eng.step() == []
    gate.set()
    outs = _step_until(eng, _finished(*rids))
    assert all(_text(tokenizer, outs[rid]) in ("hang-s", "hang-t") for rid in rids)
    assert [s for s, _ in begun].count(structured.canonical(spec)) == 1


def test_a_compile_past_its_bound_is_refused_and_later_compiles_still_run(tokenizer: Any,
                                                                          compiled_specs: Any) -> None:
    gate, begun = compiled_specs
    clock = FakeClock()
    eng = _engine(tokenizer, clock)

    def hung_pair(first: int) -> None:
        rids = [f"hung{first + i}" for i in range(COMPILE_THREADS)]
        for i, rid in enumerate(rids):
            eng.add_request(rid, [1, 2, 3], _shaped(_choice(f"hang-{first + i}")))
        assert eng.step() == []
        clock.t += BOUND_S + 1
        outs = _step_until(eng, _finished(*rids), wall_s=30)
        for rid in rids:
            (o,) = outs[rid]
            assert (o.new_token_ids, o.finish_reason) == ([], "length")
            assert o.error is not None and f"did not compile within {BOUND_S:g} s" in o.error
            assert o.error_code == "invalid_request"

    hung_pair(0)
    assert MAX_OVERDUE >= COMPILE_THREADS  # the next steps assume room for one more stuck pair
    # Both compile threads are stuck, yet a new compile starts (a fresh thread) and its request is served.
    eng.add_request("ok1", [1, 2, 3], _shaped(_choice("yes", "no")))
    assert _text(tokenizer, _step_until(eng, _finished("ok1"))["ok1"]) in ("yes", "no")

    hung_pair(COMPILE_THREADS)  # now COMPILE_THREADS + MAX_OVERDUE threads are stuck: the cap
    eng.add_request("ok2", [1, 2, 3], _shaped(_choice("up", "down")))
    assert eng.step() == []
    clock.t += BOUND_S + 1
    (o,) = _step_until(eng, _finished("ok2"), wall_s=30)["ok2"]
    assert o.error is not None and "busy" in o.error and o.error_code == "grammar_busy"  # a 503: retry
    assert not any('"up"' in spec for spec, _ in begun)  # it never started: no thread beyond the cap

    gate.set()  # the stuck compiles end; their threads go, and their grammars are kept
    eng.add_request("ok3", [1, 2, 3], _shaped(_choice("left", "right")))
    assert _text(tokenizer, _step_until(eng, _finished("ok3"))["ok3"]) in ("left", "right")
    assert eng.structured is not None
    eng.structured.compiled(_choice("hang-0"))  # (blocking, test only) until that late compile has ended
    eng.add_request("late", [1, 2, 3], _shaped(_choice("hang-0")))
    assert eng.structured.num_waiting == 0  # the compile that finished after its bound is in the cache
    assert _text(tokenizer, _step_until(eng, _finished("late"))["late"]) == "hang-0"


def test_the_tokenizer_load_is_not_counted_against_the_bound(tokenizer: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compile also loads the tokenizer (seconds on a slow machine): a trivial schema must not be
    refused as too slow because of it, nor may the other requests wait for it."""
    import llguidance.hf

    gate, real = threading.Event(), llguidance.hf.from_tokenizer

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        gate.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow_load)
    clock = FakeClock()
    eng = tiny_engine(hf_model(vocab_size=49152, eos_token_id=EOS, bos_token_id=1), max_num_batched_tokens=256)
    structured.enable(eng, tokenizer, compile_timeout_s=BOUND_S, clock=clock)
    try:
        eng.add_request("plain", [1, 5, 6], _plain(10))
        eng.add_request("first", [1, 2, 3], _shaped(_choice("yes", "no")))
        clock.t += 3 * BOUND_S  # the load outlasts the bound
        outs = _step_until(eng, _finished("plain"), wall_s=60)
        assert list(outs) == ["plain"] and sum(len(o.new_token_ids) for o in outs["plain"]) == 10
        assert eng.step() == [] and eng.has_unfinished()  # still parked, not refused
        gate.set()
        assert _text(tokenizer, _step_until(eng, _finished("first"))["first"]) in ("yes", "no")
    finally:
        gate.set()


def test_a_parked_request_can_be_aborted(tokenizer: Any, compiled_specs: Any) -> None:
    gate, begun = compiled_specs
    eng = _engine(tokenizer, FakeClock())
    rids = [f"p{i}" for i in range(COMPILE_THREADS + 1)]  # the last one's compile waits for a thread
    for i, rid in enumerate(rids):
        eng.add_request(rid, [1, 2, 3], _shaped(_choice(f"hang-{i}")))
    assert eng.has_unfinished() and eng.stats().num_waiting == len(rids)
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request(rids[0], [1, 2, 3], _plain(4))

    eng.abort(rids)
    outs = eng.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason, o.error) for o in outs] == [
        (rid, [], "abort", None) for rid in rids]
    assert outs[0].timings is not None and outs[0].timings.scheduled is None
    assert not eng.has_unfinished() and eng.stats().num_waiting == 0

    gate.set()
    eng.add_request("ok", [1, 2, 3], _shaped(_choice("yes", "no")))
    assert _text(tokenizer, _step_until(eng, _finished("ok"))["ok"]) in ("yes", "no")
    queued = f'"hang-{COMPILE_THREADS}"'
    assert not any(queued in spec for spec, _ in begun)  # nobody wanted it any more: never compiled


def test_only_parked_requests_wait_instead_of_spinning(tokenizer: Any, compiled_specs: Any) -> None:
    eng = _engine(tokenizer, FakeClock())
    eng.add_request("p", [1, 2, 3], _shaped(_choice("hang-p")))
    steps, t0 = 0, time.monotonic()
    while (elapsed := time.monotonic() - t0) < 0.3:
        assert eng.step() == []
        steps += 1
    assert steps <= elapsed / IDLE_POLL_S + 2  # a spinning loop makes thousands


def test_a_deep_schema_compiles_beside_the_engine(tokenizer: Any, compiled_specs: Any) -> None:
    """The issue's case for real: an object nested 40 deep (4.8 KB). Its compile runs in a compile thread and
    the outputs validate."""
    _, begun = compiled_specs
    schema: dict[str, Any] = {"type": "string", "maxLength": 3}
    for i in range(40):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   f"n{i}": schema},
                  "required": [f"k{i}", f"n{i}"], "additionalProperties": False}
    eng = _engine(tokenizer, FakeClock())
    eng.add_request("plain", [1, 5, 6], _plain(30))
    spec = json.dumps({"type": "json_schema", "schema": schema})
    eng.add_request("deep", [1, 9, 9], _shaped(spec, max_tokens=2000))
    out = _step_until(eng, _finished("plain", "deep"))
    jsonschema.validate(json.loads(_text(tokenizer, out["deep"])), schema)
    assert [name for s, name in begun if s == structured.canonical(spec)] == ["grammar-compile"]
    assert sum(len(o.new_token_ids) for o in out["plain"]) == 30


class FakeIO:
    """What Worker needs of WorkerIO, driven by a script: take() returns what ``script`` says."""

    def __init__(self, script: Callable[[FakeIO], list[GatewayToWorker | StopRequest]]) -> None:
        self.clock = StepClock()
        self.script = script
        self.sent: list[Any] = []
        self.takes = 0
        self.snapshot: EngineSnapshot | None = None

    def take(self, timeout: float) -> list[GatewayToWorker | StopRequest]:
        self.takes += 1
        return self.script(self)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def finished(self, rid: str) -> bool:
        """Its last output or a RequestError was sent."""
        return any(isinstance(m, RequestError) and m.request_id == rid for m in self.sent) or any(
            o.request_id == rid and o.finish_reason is not None
            for m in self.sent if isinstance(m, StepOutputs) for o in m.outputs)


def test_the_worker_loop_serves_others_and_idles_while_a_grammar_compiles(tokenizer: Any,
                                                                          compiled_specs: Any) -> None:
    gate, _ = compiled_specs
    eng = _engine(tokenizer, FakeClock())
    parked_only: dict[str, float] = {}
    give_up = time.monotonic() + 120

    def script(io: FakeIO) -> list[GatewayToWorker | StopRequest]:
        if io.takes == 1:
            return [Generate("plain", [1, 5, 6], _plain(20), None, 1.0, None, None),
                    Generate("shaped", [1, 7, 8], _shaped(_choice("hang-w")), None, 1.0, None, None)]
        if io.finished("shaped") or time.monotonic() > give_up:
            return [StopRequest("test over")]
        if io.finished("plain") and not gate.is_set():
            parked_only.setdefault("since", time.monotonic())
            parked_only.setdefault("takes", io.takes)
            if time.monotonic() - parked_only["since"] >= 0.3:
                parked_only["loops"] = io.takes - parked_only["takes"]
                parked_only["elapsed"] = time.monotonic() - parked_only["since"]
                gate.set()
        return []

    io = FakeIO(script)
    assert Worker(eng, io).run() == "test over"  # type: ignore[arg-type]
    assert parked_only["loops"] <= parked_only["elapsed"] / IDLE_POLL_S + 2  # it waited, it did not spin
    outs = [o for m in io.sent if isinstance(m, StepOutputs) for o in m.outputs]
    plain = [o for o in outs if o.request_id == "plain"]
    assert sum(len(o.new_token_ids) for o in plain) == 20 and plain[-1].finish_reason == "length"
    shaped = [t for o in outs if o.request_id == "shaped" for t in o.new_token_ids]
    assert tokenizer.decode(shaped[:-1]) == "hang-w" and shaped[-1] == EOS
