"""Routing and admission policy over workers, as a pure object (no sockets, no clock): easy to unit test.

- Admission: each worker takes at most ``max_requests`` in-flight requests and ``max_prompt_tokens`` prompt
  tokens from this gateway; past that on every worker the request is refused (503) instead of queued here.
- Affinity: requests with the same cache salt and prompt prefix prefer the worker that served that prefix
  last (its prefix cache likely holds the blocks), unless that worker is much busier than the least loaded.
- Otherwise: the least loaded worker (fewest in-flight requests, then lowest KV usage).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import AdmissionConfig

# Prefix lengths (tokens) whose hashes key the affinity map, longest first: a long shared prefix (a system
# prompt, a document) matches at 1024 or 256; a short one at 64. Shorter prompts are not worth steering.
AFFINITY_PREFIXES = (1024, 256, 64)


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    requests: int  # in flight from this gateway
    prompt_tokens: int  # prompt tokens in flight from this gateway
    kv_usage: float  # 0..1, from the worker's last Stats


def prefix_keys(cache_salt: str | None, prompt_ids: Sequence[int]) -> list[bytes]:
    keys = []
    for n in AFFINITY_PREFIXES:
        if len(prompt_ids) >= n:
            h = hashlib.blake2b(digest_size=16)
            h.update((cache_salt or "").encode() + b"\x00")
            h.update(b"".join(t.to_bytes(4, "little") for t in prompt_ids[:n]))
            keys.append(h.digest())
    return keys


class Router:
    """Owns the affinity map. Call ``choose`` then, once the request is sent, ``record``."""

    def __init__(self, admission: AdmissionConfig) -> None:
        self.admission = admission
        self._affinity: OrderedDict[bytes, str] = OrderedDict()  # LRU: prefix hash -> worker id

    def can_admit(self, w: WorkerLoad, prompt_len: int) -> bool:
        a = self.admission
        # A prompt larger than the token bound alone is still admitted to an idle worker: the bound limits
        # queueing, it must not make big (but valid) prompts impossible.
        fits_tokens = w.prompt_tokens + prompt_len <= a.max_prompt_tokens or w.requests == 0
        return w.requests < a.max_requests and fits_tokens

    def choose(self, workers: Sequence[WorkerLoad], keys: Sequence[bytes], prompt_len: int) -> str | None:
        """The worker to send to, or None when no worker can take the request now."""
        open_ = [w for w in workers if self.can_admit(w, prompt_len)]
        if not open_:
            return None
        least = min(open_, key=lambda w: (w.requests, w.kv_usage, w.worker_id))
        by_id = {w.worker_id: w for w in open_}
        for key in keys:
            wid = self._affinity.get(key)
            if wid is None:
                continue
            w = by_id.get(wid)
            if w is not None and w.requests - least.requests <= self.admission.affinity_slack:
                return w.worker_id
            break  # the longest known prefix's worker is full or too busy: balance instead
        return least.worker_id

    def record(self, keys: Sequence[bytes], worker_id: str) -> None:
        for key in keys:
            self._affinity[key] = worker_id
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.admission.affinity_entries:
            self._affinity.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for key in [k for k, w in self._affinity.items() if w == worker_id]:
            del self._affinity[key]
