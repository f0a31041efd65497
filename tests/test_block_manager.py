"""Block manager: exact block ids, ref counts, eviction order and salt-scoped prefix hashes."""

from __future__ import annotations

import pytest

from workers.core.block_manager import BlockManager, hash_block
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt, max_total_tokens=10_000)


def computed(bm: BlockManager, r: Request, n: int) -> None:
    """Pretend the model computed ``n`` more tokens of ``r`` and register its full blocks."""
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)


def test_allocation_takes_free_list_head_in_order() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert bm.block_table("a") == [0, 1, 2]
    b = req("b", list(range(5)))
    assert bm.allocate_slots(b, 5)
    assert bm.block_table("b") == [3, 4]
    assert bm.num_free_blocks == 3 and bm.free_block_ids() == [5, 6, 7]


def test_growth_by_one_token_adds_a_block_only_at_boundaries() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(4)))
    assert bm.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    assert bm.allocate_slots(a, 0) and bm.block_table("a") == [0]
    assert bm.allocate_slots(a, 1) and bm.block_table("a") == [0, 1]
    a.num_computed_tokens = 5
    assert bm.allocate_slots(a, 1) and bm.block_table("a") == [0, 1]


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    a = req("a", list(range(12)))
    assert bm.allocate_slots(a, 12)
    b = req("b", list(range(8)))
    assert not bm.allocate_slots(b, 8)
    assert bm.block_table("b") == [] and bm.free_block_ids() == [3]


def test_free_order_tail_first_and_unhashed_blocks_go_to_front() -> None:
    bm = BlockManager(6, 4)
    a = req("a", list(range(10)))  # blocks 0,1 full (hashed), block 2 partial (no hash)
    assert bm.allocate_slots(a, 10)
    computed(bm, a, 10)
    bm.free("a")
    # Partial block 2 is useless: evicted first. Full blocks freed tail first: 1 before 0.
    assert bm.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert bm.usage == 0.0


def test_prefix_hit_reuses_freed_blocks_and_eviction_forgets_them() -> None:
    bm = BlockManager(6, 4)
    a = req("a", list(range(9)))
    assert bm.allocate_slots(a, 9)
    computed(bm, a, 9)
    bm.free("a")
    b = req("b", list(range(9)) + [50])
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, 2, hits)  # 8 cached + 2 new tokens -> 3 blocks
    assert bm.block_table("b") == [0, 1, 2]
    assert bm.blocks[0].ref_cnt == 1 and 0 not in bm.free_block_ids()
    bm.free("b")
    # Allocate everything: evicts the cached blocks, after which they are no longer found.
    c = req("c", list(range(100, 124)))
    assert bm.allocate_slots(c, 24)
    bm.free("c")
    assert bm.find_cached_prefix(req("d", list(range(9)) + [1])) == []


def test_shared_blocks_are_ref_counted() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(8)) + [99])
    assert bm.allocate_slots(a, 9)
    computed(bm, a, 9)
    b = req("b", list(range(8)) + [77])
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, 1, hits)
    assert [bm.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    bm.free("a")
    assert [bm.blocks[i].ref_cnt for i in (0, 1)] == [1, 1] and 0 not in bm.free_block_ids()
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_whole_prompt_cached_still_leaves_one_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    computed(bm, a, 8)
    assert bm.find_cached_prefix(req("b", list(range(8)))) == [0]


def test_salt_scopes_the_hash_chain() -> None:
    bm = BlockManager(8, 4)
    a = req("a", list(range(9)), salt="t1")
    assert bm.allocate_slots(a, 9)
    computed(bm, a, 9)
    assert bm.find_cached_prefix(req("b", list(range(9)), salt="t2")) == []
    assert bm.find_cached_prefix(req("c", list(range(9)), salt=None)) == []
    assert bm.find_cached_prefix(req("d", list(range(9)), salt="t1")) == [0, 1]
    assert hash_block(None, [1, 2], "x") != hash_block(None, [1, 2], "y")
    assert hash_block(b"p", [1, 2], None) != hash_block(b"q", [1, 2], None)


def test_cached_hit_blocks_count_against_free_space() -> None:
    bm = BlockManager(3, 4)
    a = req("a", list(range(8)) + [1])
    assert bm.allocate_slots(a, 9)
    computed(bm, a, 9)
    bm.free("a")  # blocks 0,1 cached and free; 2 free
    b = req("b", list(range(8)) + list(range(50, 58)))  # hits 2 blocks, needs 2 more: 4 > 3
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert not bm.allocate_slots(b, 8, hits)
    assert bm.free_block_ids() == [2, 1, 0] and bm.blocks[0].ref_cnt == 0


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
