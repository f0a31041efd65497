"""The priority scheduling policy (vLLM's ``priority`` field, lower sooner), driven step by step with no model:
the waiting order, aging, preemption by a better-placed arrival (a sequence slot or KV blocks), a worse prefill
chunk held back for an arrival, fcfs refusing priorities, and a property test over random workloads (every
request ends exactly once, the block accounting holds, nothing starves)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.core.block_manager import BlockManager
from workers.core.outputs import SampledToken, SchedulerOutput
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import Scheduler
from workers.core.scheduler_config import SchedulerConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def mk(rid: str, n: int, priority: int = 0, *, t: float = 0.0, salt: str | None = None, out: int = 3) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 97)  # distinct prompts per id: no shared prefixes
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=out, temperature=0.0),
                   cache_salt=salt, arrival_time=t, max_total_tokens=10_000, priority=priority)


def sched(*, blocks: int = 64, bs: int = 4, seqs: int = 8, budget: int = 32, policy: str = "priority",
          clock: Clock | None = None, background: int | None = None) -> Scheduler:
    # background: the background prefill budget (prompt chunks of requests above 0); None: as large as the step's,
    # since these tests are about order, aging and preemption (tests/test_scheduler_background.py covers the cap)
    cfg = SchedulerConfig(seqs, budget, policy=policy, background_prefill_tokens=background or budget)
    return Scheduler(cfg, BlockManager(blocks, bs), clock or Clock())


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: SampledToken(7) for x in out.scheduled if x.samples})
    return out


def test_better_placed_requests_are_admitted_first() -> None:
    s = sched(seqs=1)
    s.add_request(mk("bulk", 4, 100))
    s.add_request(mk("chat", 4, 0, t=1.0))  # arrived later, placed better
    assert plan(step(s)) == {"chat": 4}


def test_aging_bounds_how_long_a_bulk_request_waits() -> None:
    clock = Clock()
    s = sched(seqs=1, clock=clock)
    s.add_request(mk("bulk", 4, 100))
    clock.t = 101.0  # waited 101 s: it competes at 0 now (never better than that)
    s.add_request(mk("chat", 4, 0, t=101.0))
    assert plan(step(s)) == {"bulk": 4}  # same level, earlier arrival


def test_an_arrival_preempts_worse_placed_running_requests_for_a_slot() -> None:
    s = sched(seqs=2)
    s.add_request(mk("b1", 4, 50))
    s.add_request(mk("b2", 4, 100, t=0.5))
    step(s)
    s.add_request(mk("chat", 4, 0, t=1.0))
    out = step(s)
    assert out.preempted_ids == ["b2"] and plan(out) == {"b1": 1, "chat": 4}  # the worst-placed one made room
    assert s.num_preemptions == 1


def test_an_arrival_preempts_for_kv_blocks() -> None:
    s = sched(blocks=6, bs=4, seqs=8, budget=64)  # 24 token slots
    s.add_request(mk("bulk", 20, 100))
    step(s)
    s.add_request(mk("chat", 8, 0, t=1.0))
    out = step(s)
    assert out.preempted_ids == ["bulk"] and plan(out) == {"chat": 8}


def test_a_worse_prefill_chunk_waits_for_a_better_arrival() -> None:
    s = sched(budget=8)
    s.add_request(mk("bulk", 40, 100))
    assert plan(step(s)) == {"bulk": 8}
    s.add_request(mk("chat", 6, 0, t=1.0))
    assert plan(step(s)) == {"chat": 6}  # the budget goes to the arrival; bulk is not preempted, only paused
    assert plan(step(s)) == {"chat": 1, "bulk": 7}


def test_fcfs_refuses_priorities_and_keeps_admission_order() -> None:
    s = sched(policy="fcfs")
    with pytest.raises(ValueError, match="priority scheduling policy"):
        s.add_request(mk("x", 4, 5))
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([-1, 0, 0, 5, 100]), st.integers(1, 6),
                          st.integers(0, 3)), min_size=1, max_size=24))
def test_random_workloads_end_exactly_once(reqs: list[tuple[int, int, int, int]]) -> None:
    check_random_workload(reqs, background=None)


def check_random_workload(reqs: list[tuple[int, int, int, int]], background: int | None) -> None:
    """Every request ends exactly once, blocks are held by running requests only (``background``: the background
    prefill budget; None: as large as the step's)."""
    clock = Clock()
    s = sched(blocks=20, bs=4, seqs=4, budget=16, clock=clock, background=background)
    pending = [mk(f"r{i}", n, p, t=float(i), salt=f"s{salt}", out=o) for i, (n, p, o, salt) in enumerate(reqs)]
    finished: list[str] = []
    for k in range(5_000):
        clock.t = float(k)
        if pending and k % 2 == 0:
            r = pending.pop(0)
            r.arrival_time = clock.t
            s.add_request(r)
        out = s.schedule()
        reported = s.update_from_output(out, {x.request.request_id: SampledToken(7) for x in out.scheduled
                                              if x.samples})
        finished += [o.request_id for o in reported if o.finished]
        # distinct blocks: requests of one salt whose prompts share a prefix share its cached blocks
        held = len({b for r in s.running for b in s.bm.block_table(r.request_id)})
        assert s.bm.num_free_blocks + held <= s.bm.num_blocks  # blocks are held by running requests only
        assert not {r.request_id for r in s.running} & {r.request_id for r in s.waiting}
        if not pending and not s.has_unfinished():
            break
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(reqs)))  # all ended, each once: none starved
