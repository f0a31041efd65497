"""A worker sizes its steps again while idle (workers.process.step_sizing.Resizer): a start beside other work
measured the machine slow (3.6 s a step) and kept the floor budget for life; contention only adds time, so the
fastest probe times seen win. The probes are not traffic: counters and the prefix cache are as before."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from ipc.messages import GatewayToWorker, StepOutputs
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.process import step_sizing
from workers.process.worker import Worker
from workers.process.worker_io import EngineSnapshot, StepClock, StopRequest
from tests.tiny import hf_model, run_all, tiny_engine

BUSY: Callable[[Any, int, str], float] = lambda eng, n, tag: 3600.0 + 1.0 * n  # noqa: E731 (the start that went wrong)
QUIET: Callable[[Any, int, str], float] = lambda eng, n, tag: 10.0 + 1.0 * n  # noqa: E731


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model()


def _machine(monkeypatch: pytest.MonkeyPatch, others: float | None) -> None:
    """What the probes see other processes use of the machine from now on."""
    monkeypatch.setattr(step_sizing, "_watch", lambda: (lambda: others))


def test_a_busy_start_is_corrected_at_idle_times_until_a_round_runs_on_a_quiet_machine(
        monkeypatch: pytest.MonkeyPatch, hf: Any) -> None:
    engine = tiny_engine(hf, max_num_batched_tokens=64, max_num_seqs=8)
    monkeypatch.setattr(step_sizing, "_prefill_ms", BUSY)
    _machine(monkeypatch, 0.5)  # others used half the CPUs during start-up's probes
    sizing, times = step_sizing.measure(engine, 500.0, max_num_seqs=8)
    assert sizing.max_num_batched_tokens == 8 + step_sizing.MIN_PREFILL_CHUNK and times.contended  # the floor
    step_sizing.apply(engine, sizing.max_num_batched_tokens)
    clock = FakeClock()
    resizer = step_sizing.Resizer(sizing, times, 8, clock, jitter=lambda: 0.0)

    clock.now = 10.0
    assert not resizer.due(idle_s=60.0)  # too soon after start-up's probe
    clock.now = 31.0
    assert not resizer.due(idle_s=4.0)  # not idle long enough
    assert resizer.due(idle_s=6.0)

    monkeypatch.setattr(step_sizing, "_prefill_ms", QUIET)
    calls = iter(range(100))
    # A message arrives after three probes: the round ends there, the budget is the one it had, and it is
    # still due (an interrupted round is tried again).
    assert resizer.maybe_run(engine, 6.0, lambda: next(calls) >= 3) is None
    assert engine.scheduler.config.max_num_batched_tokens == 40 and not engine.has_unfinished()
    assert resizer.due(idle_s=6.0)

    new = resizer.maybe_run(engine, 6.0, lambda: False)  # faster, but the machine was busy again: one more round
    assert new is not None and (new.max_num_batched_tokens, round(new.fixed_ms, 6)) == (498, 10.0)
    assert engine.scheduler.config.max_num_batched_tokens == 498

    clock.now = 90.0
    assert not resizer.due(idle_s=60.0)  # the next round is 60 s after the last
    clock.now = 92.0
    monkeypatch.setattr(step_sizing, "_prefill_ms", BUSY)  # slower: the quiet round's times stay
    _machine(monkeypatch, 0.0)
    assert resizer.maybe_run(engine, 6.0, lambda: False) is None
    assert engine.scheduler.config.max_num_batched_tokens == 498 and resizer.rounds == 2
    clock.now = 1e9
    assert not resizer.due(idle_s=1e9)  # a round on a quiet machine: done


@pytest.mark.parametrize("others,rounds", [(0.02, 0), (None, step_sizing.RESIZE_MAX_ROUNDS),
                                           (0.3, step_sizing.RESIZE_MAX_ROUNDS)])
def test_rounds_only_after_a_contended_or_unknown_start_and_at_most_so_many(
        monkeypatch: pytest.MonkeyPatch, hf: Any, others: float | None, rounds: int) -> None:
    engine = tiny_engine(hf, max_num_batched_tokens=64, max_num_seqs=8)
    monkeypatch.setattr(step_sizing, "_prefill_ms", QUIET)
    _machine(monkeypatch, others)  # the same all along
    sizing, times = step_sizing.measure(engine, 500.0, max_num_seqs=8)
    clock = FakeClock()
    resizer = step_sizing.Resizer(sizing, times, 8, clock, jitter=lambda: 0.0)
    for _ in range(20):
        clock.now += 1e6
        resizer.maybe_run(engine, 60.0, lambda: False)
    assert resizer.rounds == rounds and not resizer.due(idle_s=60.0)


def test_the_watch_counts_other_processes_and_not_this_one() -> None:
    """Whatever else runs (a CI machine's other tests): the share includes a CPU-bound child's time and leaves out
    this process's own busy loop."""
    import psutil

    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 10\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        child = psutil.Process(hog.pid)
        h0, own0, t0 = sum(child.cpu_times()[:2]), sum(os.times()[:2]), time.monotonic()
        watch = step_sizing._watch()
        while time.monotonic() - t0 < 1.0:
            pass
        share = watch()
        h1, own1, t1 = sum(child.cpu_times()[:2]), sum(os.times()[:2]), time.monotonic()
    finally:
        hog.kill()
        hog.wait()
    if share is None:  # no /proc/stat here: nothing to tell either way
        assert not os.path.exists("/proc/stat")
        return
    capacity = (t1 - t0) * (os.cpu_count() or 1)
    assert share >= (h1 - h0) / capacity - 0.05, (share, h1 - h0)  # the child counted
    assert share <= 1.0 - (own1 - own0) / capacity + 0.05, (share, own1 - own0)  # this process did not


def test_idle_probes_leave_counters_and_tenants_cached_prefixes_as_they_were(hf: Any) -> None:
    # 128 blocks of 4 tokens; a 200-token prompt leaves 51 of them cached and free, 77 never used. A short probe
    # takes 9 blocks, a long one 33, from the never used ones first. If the probes' own cache entries stayed at the
    # back of the free list, the fourth probe (9 + 33 + 9 + 33 > 77) would take the tenant's, evicting its prefix.
    engine = tiny_engine(hf, block_size=4, kv_cache_tokens=512, max_num_batched_tokens=512, max_num_seqs=8,
                         max_model_len=512)
    prompt = [(i * 31 + 7) % 97 + 3 for i in range(200)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("tenant-1", prompt, params)
    first = run_all(engine)["tenant-1"]
    before, cached = engine.stats(), engine.scheduler.bm.cached_hashes()

    sizing = step_sizing.StepSizing(40, 3600.0, 1.0, 500.0)
    times = step_sizing.ProbeTimes(1e9, 1e9, 128)  # anything real is faster
    clock = FakeClock()
    resizer = step_sizing.Resizer(sizing, times, 8, clock, jitter=lambda: 0.0)
    clock.now = 31.0
    new = resizer.maybe_run(engine, 6.0, lambda: False)
    assert new is not None and engine.scheduler.config.max_num_batched_tokens == new.max_num_batched_tokens
    assert engine.stats() == before and not engine.has_unfinished()
    assert engine.scheduler.bm.cached_hashes() == cached  # the probes' entries are gone, the tenant's stay

    engine.add_request("tenant-2", prompt, params)
    hits: list[int] = []
    while engine.has_unfinished():
        hits += [o.num_cached_tokens for o in engine.step() if o.request_id == "tenant-2" and o.new_token_ids]
    assert hits[0] == 196  # 49 full blocks: the whole prompt but the block holding its last token
    assert engine.stats().prompt_tokens_total == before.prompt_tokens_total + 200
    assert first  # served


class IdleIO:
    """What Worker needs of WorkerIO: never a message until the budget it publishes changed, then a stop."""

    def __init__(self, start_budget: int, pending: Callable[[], bool] = lambda: False) -> None:
        self.clock = StepClock()
        self.start_budget, self.pending = start_budget, pending
        self.snapshot: EngineSnapshot | None = None
        self.takes = 0

    def take(self, timeout: float) -> list[GatewayToWorker | StopRequest]:
        self.takes += 1
        changed = self.snapshot is not None and self.snapshot.max_num_batched_tokens != self.start_budget
        return [StopRequest("test over")] if changed or self.takes > 50 else []

    def has_messages(self) -> bool:
        return self.pending()

    def send(self, msg: Any) -> None:
        assert isinstance(msg, StepOutputs)

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot


def test_each_worker_s_rounds_come_at_their_own_times() -> None:
    sizing, times = step_sizing.StepSizing(40, 3600.0, 1.0, 500.0), step_sizing.ProbeTimes(3632.0, 3728.0, 128)
    clock = FakeClock()
    late = step_sizing.Resizer(sizing, times, 8, clock, jitter=lambda: step_sizing.RESIZE_JITTER)
    clock.now = 31.0
    assert not late.due(idle_s=60.0)  # its first round is at 45 s
    clock.now = 45.0
    assert late.due(idle_s=60.0)
    spread = set()
    for _ in range(20):
        random.seed(0)  # the draw is the OS's: the global generator seeded alike in every worker changes nothing
        spread.add(round(step_sizing.Resizer(sizing, times, 8, clock)._next, 3))
    assert len(spread) > 1 and all(30.0 <= t <= 45.0 for t in spread)


def _idle_worker(engine: LLMEngine, io: IdleIO, monkeypatch: pytest.MonkeyPatch) -> step_sizing.Resizer:
    monkeypatch.setattr(step_sizing, "RESIZE_IDLE_S", 0.0)
    monkeypatch.setattr(step_sizing, "RESIZE_FIRST_S", 0.0)
    monkeypatch.setattr(step_sizing, "_prefill_ms", QUIET)
    resizer = step_sizing.Resizer(step_sizing.StepSizing(40, 3600.0, 1.0, 500.0),
                                  step_sizing.ProbeTimes(3632.0, 3728.0, 128), 8)
    assert Worker(engine, io, resizer=resizer).run() == "test over"  # type: ignore[arg-type]
    return resizer


def test_the_idle_worker_loop_sizes_again_and_its_heartbeats_carry_the_budget(
        monkeypatch: pytest.MonkeyPatch, hf: Any) -> None:
    engine = tiny_engine(hf, max_num_batched_tokens=40, max_num_seqs=8)
    io = IdleIO(40)
    start = time.monotonic()
    resizer = _idle_worker(engine, io, monkeypatch)
    assert resizer.sizing.max_num_batched_tokens == 498 and io.takes < 50
    assert io.snapshot is not None and io.snapshot.max_num_batched_tokens == 498
    assert engine.scheduler.config.max_num_batched_tokens == 498
    assert time.monotonic() - start < 30  # it did not wait for a timeout of the script


def test_a_waiting_message_keeps_the_idle_worker_from_probing(monkeypatch: pytest.MonkeyPatch, hf: Any) -> None:
    engine = tiny_engine(hf, max_num_batched_tokens=40, max_num_seqs=8)
    io = IdleIO(40, pending=lambda: True)
    resizer = _idle_worker(engine, io, monkeypatch)
    assert io.takes == 51 and resizer.sizing.max_num_batched_tokens == 40  # the script's stop, no probe
    assert engine.scheduler.config.max_num_batched_tokens == 40


def test_the_budget_gauge_follows_the_heartbeat_and_falls_back_to_the_hello() -> None:
    from types import SimpleNamespace

    from gateway.telemetry.metrics import _budget
    from ipc.codec import decode, encode
    from ipc.messages import Stats

    st = decode(encode(Stats("w0", 0, 0, 0.0, 10, 10, 0, 0, 0, 0, 0, 1.0, 3, None, [], 0, 0, 0, [], 498)))
    assert isinstance(st, Stats) and st.max_num_batched_tokens == 498
    hello = SimpleNamespace(max_num_batched_tokens=40)
    assert _budget(SimpleNamespace(stats=st, hello=hello)) == 498  # type: ignore[arg-type]
    assert _budget(SimpleNamespace(stats=None, hello=hello)) == 40  # type: ignore[arg-type]
