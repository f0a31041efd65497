"""Scheduler and fair queue, driven step by step with no model (the engine core is pure)."""

from __future__ import annotations

from workers.core.block_manager import BlockManager
from workers.core.fair_queue import FairQueue
from workers.core.outputs import RequestTimings, SampledToken, SchedulerOutput
from workers.core.request import Request, RequestStatus
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import Scheduler
from workers.core.scheduler_config import SchedulerConfig


def mk(rid: str, n: int, *, salt: str | None = None, weight: float = 1.0, max_tokens: int = 4,
       t: float = 0.0) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 97)  # distinct prompts per id: no accidental prefix hits
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   cache_salt=salt, weight=weight, arrival_time=t, max_total_tokens=10_000)


def plan_of(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def finish_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    s.update_from_output(out, {x.request.request_id: SampledToken(token) for x in out.scheduled if x.samples})


def sched(blocks: int = 64, bs: int = 4, seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, budget), BlockManager(blocks, bs))


def test_chunked_prefill_then_decode_first() -> None:
    s = sched(budget=16)
    s.add_request(mk("a", 20))
    s.add_request(mk("b", 6))
    out = s.schedule()
    assert plan_of(out) == {"a": 16}  # budget spent on a's first chunk
    finish_step(s, out)
    out = s.schedule()
    assert plan_of(out) == {"a": 4, "b": 6}  # running first, then b admitted
    finish_step(s, out)
    out = s.schedule()
    assert plan_of(out) == {"a": 1, "b": 1}  # both decode
    assert out.num_batched_tokens == 2


def test_max_num_seqs_caps_running() -> None:
    s = sched(seqs=2, budget=100)
    for i in range(4):
        s.add_request(mk(f"r{i}", 3))
    out = s.schedule()
    assert list(plan_of(out)) == ["r0", "r1"] and len(s.waiting) == 2


def test_preempts_latest_admitted_and_requeues_it_first() -> None:
    s = sched(blocks=4, bs=4, budget=64)
    s.add_request(mk("a", 7, max_tokens=10, t=0))
    s.add_request(mk("b", 7, max_tokens=10, t=1))
    out = s.schedule()
    assert plan_of(out) == {"a": 7, "b": 7}  # 2 blocks each: cache full
    finish_step(s, out)
    finish_step(s, s.schedule())  # position 7 still fits in block 2 of each
    out = s.schedule()  # position 8 needs a third block each, and only 4 exist
    assert plan_of(out) == {"a": 1} and out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and s.num_preemptions == 1


def test_abort_running_and_waiting() -> None:
    s = sched(seqs=1)
    s.add_request(mk("a", 5))
    s.add_request(mk("b", 5))
    s.schedule()
    s.abort(["a", "b"])
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.running and not s.waiting
    outs = s.take_finished_unreported()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert not s.has_unfinished()


def test_finish_by_max_tokens_frees_blocks() -> None:
    s = sched()
    s.add_request(mk("a", 5, max_tokens=2))
    for _ in range(2):
        finish_step(s, s.schedule())
    assert not s.has_unfinished() and s.bm.num_free_blocks == s.bm.num_blocks
    assert s.prompt_tokens_total == 5 and s.generation_tokens_total == 2


def test_fair_queue_interleaves_tenants_despite_a_burst() -> None:
    q = FairQueue()
    for i in range(6):
        q.push(mk(f"A{i}", 100, salt="A", t=i))
    q.push(mk("B0", 100, salt="B", t=10))
    q.push(mk("B1", 100, salt="B", t=11))
    order = []
    while q:
        r = q.peek()
        assert r is not None
        q.pop(r, 100)
        order.append(r.request_id)
    assert order[:4] == ["A0", "B0", "A1", "B1"]
    assert order[4:] == ["A2", "A3", "A4", "A5"]


def test_fair_queue_respects_weights() -> None:
    q = FairQueue()
    for i in range(8):
        q.push(mk(f"H{i}", 10, salt="heavy", weight=3.0, t=i))
        q.push(mk(f"L{i}", 10, salt="light", weight=1.0, t=i + 0.5))
    first8 = []
    for _ in range(8):
        r = q.peek()
        assert r is not None
        q.pop(r, 10)
        first8.append(r.request_id[0])
    assert first8.count("H") == 6 and first8.count("L") == 2


def test_idle_tenant_cannot_bank_credit() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(mk(f"A{i}", 10, salt="A", t=i))
    for _ in range(3):
        r = q.peek()
        assert r is not None
        q.pop(r, 10)
    # B arrives late; A arrives again. B must not get all of A's past service as credit.
    for i in range(3):
        q.push(mk(f"B{i}", 10, salt="B", t=10 + i))
        q.push(mk(f"A{3 + i}", 10, salt="A", t=10.5 + i))
    order = []
    while q:
        r = q.peek()
        assert r is not None
        q.pop(r, 10)
        order.append(r.request_id)
    assert order[:2] in (["A3", "B0"], ["B0", "A3"])
    assert sorted(order[2:4], key=lambda x: x[0]) in (["A4", "B1"],)


def test_fifo_within_salt_and_remove() -> None:
    q = FairQueue()
    a, b, c = mk("a", 1, salt="s", t=0), mk("b", 1, salt="s", t=1), mk("c", 1, salt="s", t=2)
    for r in (a, b, c):
        q.push(r)
    assert q.remove(b) and not q.remove(b)
    assert q.peek() is a
    q.pop(a, 1)
    assert q.peek() is c and len(q) == 1


def test_tokens_in_spans_prompt_and_output() -> None:
    r = mk("r", 4)
    r.output_token_ids = [5, 6, 7]
    full = r.all_token_ids
    assert all(r.tokens_in(a, b) == full[a:b] for a in range(8) for b in range(a, 8))


class StepClock:
    """A clock the test moves by hand: each milestone's offset is known exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_finished_outputs_carry_phase_offsets_since_arrival() -> None:
    clock = StepClock()
    s = Scheduler(SchedulerConfig(8, 4), BlockManager(64, 4), clock)
    s.add_request(mk("a", 6, max_tokens=2, t=100.0))
    clock.now = 100.5
    out = s.schedule()  # a's first chunk (4 of 6): scheduled at +0.5
    clock.now = 101.0
    assert s.update_from_output(out, {}) == []  # no token yet: nothing to report
    out = s.schedule()
    clock.now = 101.25
    [first] = s.update_from_output(out, {"a": SampledToken(7)})  # prefill done, first token at +1.25
    assert first.timings is None  # only the last output carries timings
    out = s.schedule()
    clock.now = 102.0
    [last] = s.update_from_output(out, {"a": SampledToken(8)})
    assert last.finish_reason == "length"
    assert last.timings == RequestTimings(scheduled=0.5, first_token=1.25, finished=2.0, preempted=())


def test_preemption_and_abort_in_the_queue_are_in_the_timings() -> None:
    clock = StepClock()
    s = Scheduler(SchedulerConfig(8, 64), BlockManager(4, 4), clock)
    s.add_request(mk("a", 7, max_tokens=10, t=100.0))
    s.add_request(mk("b", 7, max_tokens=10, t=100.0))
    s.add_request(mk("c", 3, max_tokens=10, t=100.0))
    finish_step(s, s.schedule())  # a and b fill the cache; c waits
    finish_step(s, s.schedule())  # position 7 still fits in block 2 of each
    clock.now = 103.0
    out = s.schedule()  # a's decode needs a third block: b, admitted last, is preempted at +3
    assert out.preempted_ids == ["b"]
    clock.now = 104.0
    s.abort(["b", "c"])
    outs = {o.request_id: o for o in s.update_from_output(out, {"a": SampledToken(7)})}
    b, c = outs["b"].timings, outs["c"].timings
    assert b is not None and b.scheduled == 0.0 and b.first_token == 0.0 and b.preempted == (3.0,)
    assert b.finished == 4.0
    assert c == RequestTimings(scheduled=None, first_token=None, finished=4.0, preempted=())


def _same_prompt(rid: str, salt: str | None, n: int = 22) -> Request:
    return Request(rid, list(range(500, 500 + n)), SamplingParams(max_tokens=2, temperature=0.0), cache_salt=salt,
                   max_total_tokens=10_000)


def test_one_prefill_for_one_prefix_arriving_together() -> None:
    # Four sequences of one prompt (a request's n) arrive together: the first computes the prompt, the others wait
    # for its blocks and hit the cache; another tenant's request (other salt: never shared) is not held up.
    s = sched(bs=4, budget=64)
    for i in range(4):
        s.add_request(_same_prompt(f"c{i}", "t1"))
    s.add_request(_same_prompt("other", "t2"))
    out = s.schedule()
    assert plan_of(out) == {"c0": 22, "other": 22}
    finish_step(s, out)
    out = s.schedule()  # c0's 5 full blocks are cached now: the rest compute the last 2 tokens each
    assert {k: v for k, v in plan_of(out).items() if k.startswith("c") and k != "c0"} == {"c1": 2, "c2": 2, "c3": 2}
    assert s.bm.prefix_hits == 3 * 20


def test_a_long_prefill_holds_back_only_its_own_prefix() -> None:
    s = sched(bs=4, budget=8)  # the prompt takes 3 chunks
    s.add_request(_same_prompt("a", "t1"))
    s.add_request(_same_prompt("b", "t1"))
    seen = []
    for _ in range(4):
        out = s.schedule()
        seen.append(plan_of(out))
        finish_step(s, out)
    # b waits while a computes the blocks it would share, then starts from the cache (not from token 0)
    assert [p.get("b") for p in seen] == [None, None, None, 2] and seen[2] == {"a": 6}
    assert s.bm.prefix_hits == 20
