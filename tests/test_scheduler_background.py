"""Background prefill budget: prompt chunks of requests placed below 0 (priority > 0: the batch tier, Batch API
lines) get at most ``background_prefill_tokens`` a step, so the step an interactive request arrives during stays
short; their decodes and everyone else's tokens are not capped. Driven step by step with no model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_scheduler_priority import Clock, check_random_workload, mk, plan, step
from workers.core.block_manager import BlockManager
from workers.core.scheduler import Scheduler
from workers.core.scheduler_config import SchedulerConfig


def sched(budget: int = 64, background: int | None = None, policy: str = "priority", seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, budget, policy=policy, background_prefill_tokens=background),
                     BlockManager(256, 4), Clock())


def test_a_background_prompt_takes_at_most_its_budget_a_step() -> None:
    s = sched(budget=128)  # default: a 32nd, 4 tokens
    s.add_request(mk("bulk", 100, 100))
    assert [plan(step(s)) for _ in range(3)] == [{"bulk": 4}] * 3


def test_the_rest_of_the_step_goes_to_better_placed_prompts() -> None:
    s = sched(budget=64, background=16)
    s.add_request(mk("bulk", 100, 100))
    s.add_request(mk("chat", 100, 0, t=1.0))
    assert plan(step(s)) == {"chat": 64}  # placed first: the whole budget
    assert plan(step(s)) == {"chat": 36, "bulk": 16}  # chat's last 36, bulk its 16 (not the 28 left)


def test_several_background_prompts_share_one_budget() -> None:
    s = sched(budget=64, background=20)
    for i in range(3):
        s.add_request(mk(f"bulk{i}", 30, 100, t=float(i)))
    first = plan(step(s))
    assert sum(first.values()) == 20 and set(first) <= {"bulk0", "bulk1", "bulk2"}


def test_background_decodes_are_not_capped() -> None:
    s = sched(budget=64, background=8)
    for i in range(6):
        s.add_request(mk(f"bulk{i}", 4, 100, t=float(i), out=20))
    for _ in range(3):  # each 4-token prompt fits one step's 8: two a step, three steps for six
        step(s)
    decoding = plan(step(s))
    assert len(decoding) == 6 and set(decoding.values()) == {1}  # six decodes in one step, past the 8-token cap


def test_requests_at_or_above_zero_are_untouched() -> None:
    for policy, prio in (("priority", 0), ("priority", -100), ("fcfs", 0)):
        s = sched(budget=64, background=8, policy=policy)
        s.add_request(mk("chat", 100, prio))
        assert plan(step(s)) == {"chat": 64}, (policy, prio)


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="background_prefill_tokens"):
        SchedulerConfig(8, 64, background_prefill_tokens=0)
    assert SchedulerConfig(8, 2).background_budget == 1  # a 32nd, at least one token
    assert SchedulerConfig(8, 1024).background_budget == 32


@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([-1, 0, 0, 5, 100]), st.integers(1, 6),
                          st.integers(0, 3)), min_size=1, max_size=24), st.integers(1, 16))
def test_random_workloads_with_a_cap_end_exactly_once(reqs: list[tuple[int, int, int, int]], cap: int) -> None:
    check_random_workload(reqs, background=cap)


# Workloads the random test found stuck. The first stalls main before this change (3ae1bf8..a871462): a held-back
# running chunk and an arrival whose cached prefix sat in the free list waited for each other (the arrival's room
# now counts those blocks). The second stalled with the background cap before running requests were compared at
# their effective level: a preempted request, aged in the queue, took its place back every step.
STUCK = [
    ([(23, -1, 3, 2), (26, -1, 3, 1), (25, 100, 3, 2), (23, 0, 5, 0), (8, 0, 4, 0), (21, 0, 3, 3), (11, 5, 6, 1),
      (36, 100, 5, 3), (12, 5, 6, 1), (31, 5, 5, 2), (40, 100, 6, 0), (14, 0, 1, 2), (25, 5, 4, 3), (3, 100, 3, 1),
      (11, 0, 6, 1), (38, 0, 4, 0), (39, 0, 5, 1), (35, 100, 4, 2), (9, 100, 5, 3), (34, -1, 4, 3), (19, 0, 4, 2),
      (25, 5, 1, 1), (32, 5, 4, 1), (14, 0, 6, 0)], None),
    ([(21, 100, 6, 2), (34, 5, 5, 3), (39, 100, 3, 3), (20, 0, 5, 3), (38, 0, 5, 1), (17, -1, 4, 0), (24, 5, 4, 2),
      (2, -1, 1, 0), (25, 0, 4, 2), (24, 5, 3, 3), (30, -1, 4, 2), (10, 5, 2, 0), (12, 0, 3, 1), (38, 0, 4, 2),
      (33, 0, 6, 3), (18, 5, 3, 3), (14, 5, 4, 3)], 3),
]


@pytest.mark.parametrize("reqs,cap", STUCK, ids=["held-back-vs-cached-arrival", "aged-victim-ping-pong"])
def test_workloads_that_once_got_stuck_end(reqs: list[tuple[int, int, int, int]], cap: int | None) -> None:
    check_random_workload(reqs, cap)
