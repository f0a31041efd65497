"""Paged KV-cache bookkeeping: blocks, ref counts, per-request block tables, and the prefix cache.

The free list is an OrderedDict used as an O(1) doubly linked list in eviction order: the head is evicted
first. Freed blocks keep their content hash and stay findable until they are handed out again, so a later
request with the same prefix (and the same cache salt) reuses them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workers.core.request import Request


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: str | None, lora: str | None = None) -> bytes:
    """H(parent, tokens, lora, extra) with SHA-256: collisions would leak one tenant's cache to another, so no
    64-bit Python hash. ``extra`` (the cache salt) and ``lora`` (the adapter the K/V were computed under: a prefix
    of one adapter is never another's, nor the base model's) are only mixed into the first block; the chain carries
    them. The adapter name is length-prefixed under its own tag, so no salt can spell a salt-and-adapter pair."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"root")
    h.update(len(tokens).to_bytes(4, "little"))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    if lora is not None:
        name = lora.encode("utf-8")
        h.update(b"lora:" + len(name).to_bytes(4, "little") + name)
    if extra is not None:
        h.update(b"salt:" + extra.encode("utf-8"))
    return h.digest()


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # content hash -> block id holding it
        self._tables: dict[str, list[int]] = {}  # request id -> physical block ids, in order
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its leading full blocks
        self.prefix_queries = 0  # prompt tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of which were found cached (counted by the scheduler on admission)

    # ---- counters ------------------------------------------------------------------------------
    def count_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """An admitted request's prompt was looked up in the prefix cache (``Stats`` reports the totals)."""
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def reset_counters(self) -> None:
        self.restore_counters(0, 0)

    def restore_counters(self, prefix_queries: int, prefix_hits: int) -> None:
        self.prefix_queries, self.prefix_hits = prefix_queries, prefix_hits

    def cached_hashes(self) -> set[bytes]:
        """The content hashes the prefix cache holds now (a copy)."""
        return set(self._cached)

    def uncache(self, hashes: Iterable[bytes]) -> None:
        """Forget these prefix-cache entries; their blocks, where free, go to the front of the free list (the
        next to be taken). A block some request still holds only loses its hash."""
        for h in hashes:
            block_id = self._cached.pop(h, None)
            if block_id is None:
                continue
            self.blocks[block_id].block_hash = None
            if block_id in self._free:
                self._free.move_to_end(block_id, last=False)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------
    def _request_hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra, lora = (req.cache_salt, req.lora) if i == 0 else (None, None)
            hashes.append(hash_block(parent, req.tokens_in(i * bs, (i + 1) * bs), extra, lora))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids holding the longest cached prefix of ``req``'s tokens. At least one token is left
        uncached, because the model must compute the last position to sample from it."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._request_hashes(req, max_blocks):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def uncomputed_prompt_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the full prompt blocks ``req`` has yet to compute (what it will add to the prefix cache)."""
        if not self.enable_prefix_caching:
            return []
        full = req.num_prompt_tokens // self.block_size
        return self._request_hashes(req, full)[req.num_computed_tokens // self.block_size:]

    def prompt_blocks_in_flight(self, computing: Iterable[Request]) -> set[bytes]:
        """The full prompt blocks these requests (a step's) are computing, by content hash."""
        return {h for r in computing if r.num_computed_tokens < r.num_prompt_tokens
                for h in self.uncomputed_prompt_hashes(r)}

    def next_uncached_hash(self, req: Request, num_hits: int) -> bytes | None:
        """The hash of the first block after ``req``'s cached prefix, if that block is full (a lookup could hit)."""
        if not self.enable_prefix_caching or num_hits >= (req.num_tokens - 1) // self.block_size:
            return None
        return self._request_hashes(req, num_hits + 1)[num_hits]

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req.request_id, [])
        n_full = min(req.num_computed_tokens // self.block_size, len(table))
        for i, h in enumerate(self._request_hashes(req, n_full)[:n_full]):
            block = self.blocks[table[i]]
            if block.block_hash is None:
                block.block_hash = h
                # Another request may have computed the same content first: keep its block findable.
                self._cached.setdefault(h, block.block_id)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Grow ``req``'s table to hold its computed tokens, ``cached_blocks`` (a prefix hit being attached
        now) and ``num_new_tokens`` more. Returns False, changing nothing, when the free blocks do not
        suffice: the caller waits or preempts."""
        table = self._tables.get(req.request_id, [])
        if cached_blocks and table:
            raise RuntimeError(f"prefix blocks attached to {req.request_id}, which already holds blocks")
        need = self._new_blocks(req, num_new_tokens, cached_blocks)
        if need + self._reclaimed(cached_blocks) > len(self._free):
            return False
        for b in cached_blocks:
            self._touch(b)
        table = self._tables.setdefault(req.request_id, [])
        table.extend(cached_blocks)
        table.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def _new_blocks(self, req: Request, num_new_tokens: int, cached_blocks: Sequence[int]) -> int:
        total = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return self.blocks_needed(total) - len(self._tables.get(req.request_id, [])) - len(cached_blocks)

    def _reclaimed(self, cached_blocks: Sequence[int]) -> int:
        """Hit blocks with no other user sit in the free list; touching them takes them out of it."""
        return sum(1 for b in cached_blocks if self.blocks[b].ref_cnt == 0)

    def free_blocks_to_allocate(self, req: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> int:
        """How many free blocks ``allocate_slots`` with these arguments would take (new ones, and cached hits
        that sit in the free list): what must be free for it to succeed."""
        return max(self._new_blocks(req, num_new_tokens, cached_blocks), 0) + self._reclaimed(cached_blocks)

    def free(self, request_id: str) -> None:
        """Drop a request's references. Tail blocks are freed first so they are evicted before the
        shared head of a prompt; blocks with no content hash are useless and go to the very front."""
        self._hashes.pop(request_id, None)
        for block_id in reversed(self._tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block_id} ref count went negative")
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Speculative decoding's rollback: free the tail blocks that hold none of the request's first
        ``num_tokens`` tokens (they were allocated for drafted tokens the model rejected). Such blocks were
        taken from the free list this step, hold no hash and no other user, so they go to its very front."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            block_id = table.pop()
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt != 0 or block.block_hash is not None:
                raise RuntimeError(f"trimmed block {block_id} is shared or cached")
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight reload)."""
        self._cached.clear()
        for b in self.blocks:
            b.block_hash = None
