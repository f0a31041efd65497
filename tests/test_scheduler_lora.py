"""LoRA in the pure scheduler: at most ``max_loras`` distinct adapters a step (base rows do not count), a request
whose adapter would be one too many waits (running: keeps its blocks; waiting: keeps its place, other queues go
on), and the adapter is part of the prefix-cache key."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_scheduler import finish_step, mk, plan_of
from workers.core.block_manager import BlockManager
from workers.core.request import Request
from workers.core.scheduler import Scheduler
from workers.core.scheduler_config import SchedulerConfig


def lora(rid: str, n: int, name: str | None, salt: str | None = None, tokens: list[int] | None = None) -> Request:
    req = dataclasses.replace(mk(rid, n, salt=salt), lora=name)
    if tokens is not None:
        req.prompt_token_ids = list(tokens)
    return req


def test_max_loras_bounds_distinct_adapters_per_step() -> None:
    s = Scheduler(SchedulerConfig(8, 64, max_loras=2), BlockManager(64, 4))
    for rid, name in (("a1", "A"), ("b1", "B"), ("c1", "C"), ("a2", "A"), ("base", None)):
        s.add_request(lora(rid, 4, name, salt=rid))  # each its own tenant queue
    out = s.schedule()
    assert set(plan_of(out)) == {"a1", "b1", "a2", "base"}  # C would be a third adapter: it waits
    finish_step(s, out)
    out = s.schedule()
    assert set(plan_of(out)) == {"a1", "b1", "a2", "base"}  # still two adapters running: C still waits
    for _ in range(4):
        finish_step(s, out)
        out = s.schedule()
    assert "c1" in plan_of(out)  # A and B finished: C's turn


def test_a_running_request_over_the_bound_waits_with_its_blocks() -> None:
    s = Scheduler(SchedulerConfig(8, 64, max_loras=2), BlockManager(64, 4))
    s.add_request(lora("a", 4, "A"))
    s.add_request(lora("b", 4, "B", salt="t2"))
    out = s.schedule()
    finish_step(s, out)
    # Both run; were the bound lower now (as after a step that admitted past running requests held back), the
    # later one waits, holding its blocks, while base requests are never held back by it
    s.config = dataclasses.replace(s.config, max_loras=1)
    s.add_request(lora("x", 4, None, salt="t3"))
    blocks_b = list(s.bm.block_table("b"))
    out = s.schedule()
    assert set(plan_of(out)) == {"a", "x"} and s.bm.block_table("b") == blocks_b
    while "b" not in plan_of(out):
        finish_step(s, out)
        out = s.schedule()
    assert "a" not in s.requests  # b ran once A's request was done


def test_the_adapter_is_part_of_the_prefix_key() -> None:
    bm = BlockManager(64, 4)
    prompt = list(range(100, 113))
    keys = {name: bm._request_hashes(lora(f"r{name}", 0, name, tokens=prompt), 3)[0] for name in ("A", "B", None)}
    assert len(set(keys.values())) == 3
    salted = bm._request_hashes(lora("s", 0, "A", salt="t", tokens=prompt), 1)[0]
    assert salted != keys["A"]


def test_max_loras_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=0)
