"""Routing and admission policy over workers, as a pure object (no sockets, no clock): easy to unit test.

Each worker runs weighted fair queuing over tenants (``workers/core/fair_queue.py``), but a worker's fair queue
weighs only the tenants whose requests wait *there*. Fair shares across the fleet therefore need every busy tenant
waiting on every worker, with room there for its weight to act; the router sees to both (issue 24 item 6):

- Spread: a tenant's in-flight requests stay spread over the open workers: a request goes to a worker only if
  that leaves it holding at most ``tenant_slack`` more of the tenant's requests than the worker holding fewest
  (that one always qualifies). Among those, the least loaded wins (fewest in-flight requests, then lowest KV
  usage).
- Affinity: requests with the same cache salt and prompt prefix prefer the worker that served that prefix last
  (its prefix cache likely holds the blocks), unless that worker is much busier than the least loaded
  (``affinity_slack``) or the spread rules it out. Affinity alone pinned each tenant with a system prompt of its
  own to one worker, and the heavier one spilled onto the other's: weights 3:1 over two workers gave the light
  tenant 0.13-0.20 of the tokens (``tests/test_gateway_fair_fleet.py``). A request's later sequences (``n``;
  ``near``: the worker of its first) may follow it past the tenant slack: they share its prompt's blocks.
  A request that names OpenAI's ``prompt_cache_key`` has one more key before its prefixes (``cache_key``, within
  its tenant): the client says which requests share a prefix, so they go where the last one with that key went.
  A request with a LoRA adapter has one more key after its prefixes (``adapter_key``): with no known prefix, it
  prefers the worker that ran that adapter last (which likely holds it resident, so it runs without a load), on
  the same terms.
- Admission: each worker takes ``max_requests`` in-flight requests and ``max_prompt_tokens`` prompt tokens from
  this gateway; past that the request is refused (503) instead of queued here, unless its tenant holds less of
  that worker than its weighted share of both bounds (its weight over the weights of the tenants holding
  requests there, its own included): then it still gets in, up to twice the bounds, never more. Otherwise a
  worker full of one tenant's queue gives the other tenants' weights nothing to act on and every freed slot goes
  to whoever retries first: weights 3:1 got 0.60-0.63 / 0.37-0.40. A tenant over its share gets in only below
  the bounds, so a worker past them holds tenants under their shares, whose requests drain it back.
- Tiers: a request's tier (``tenancy/tiers.py``) scales both bounds and the share rule's ceiling by its capacity
  share (``Placement.share``), counting every request on the worker whatever its tier: a batch request is
  refused once the worker holds half the bounds, a standard one at the bounds (share 1: as before tiers), an
  interactive one 25% past them. The gap between a tier's bounds and the next higher tier's is headroom only the
  higher ones can fill. ``reserved`` tells a refusal by a tier's share below the bounds as configured (a 429 of
  its tier) from a refusal at those bounds (a 503, as before tiers).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.config import AdmissionConfig
from tenancy.tiers import BASE_SHARE

# Prefix lengths (tokens) whose hashes key the affinity map, longest first: a long shared prefix (a system
# prompt, a document) matches at 1024 or 256; a short one at 64. Shorter prompts are not worth steering.
AFFINITY_PREFIXES = (1024, 256, 64)
MIN_WEIGHT = 1e-6  # as the workers' fair queue: a weight is > 0 (tenancy checks it); never divide by zero


class TenantCounts:
    """One worker's in-flight requests and prompt tokens by tenant (the cache salt: what the workers' fair queues
    share by) and each such tenant's weight. The pool keeps it in step with the worker's requests."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._weight: dict[str, float] = {}

    def add(self, tenant: str, weight: float, prompt_len: int) -> None:
        self._count[tenant] = self._count.get(tenant, 0) + 1
        self._tokens[tenant] = self._tokens.get(tenant, 0) + prompt_len
        self._weight[tenant] = max(weight, MIN_WEIGHT)  # the newest: an operator may change it mid-flight

    def remove(self, tenant: str, prompt_len: int) -> None:
        left = self._count.get(tenant, 0) - 1
        if left > 0:
            self._count[tenant] = left
            self._tokens[tenant] -= prompt_len
        else:
            for d in (self._count, self._tokens, self._weight):
                d.pop(tenant, None)

    def held(self, tenant: str) -> int:
        return self._count.get(tenant, 0)

    def held_tokens(self, tenant: str) -> int:
        return self._tokens.get(tenant, 0)

    def share(self, tenant: str, weight: float) -> float:
        """``tenant``'s weighted share of this worker among the tenants holding requests here, itself included."""
        weight = max(weight, MIN_WEIGHT)
        return weight / (weight + sum(w for t, w in self._weight.items() if t != tenant))

    def __len__(self) -> int:
        return len(self._count)


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    requests: int  # in flight from this gateway
    prompt_tokens: int  # prompt tokens in flight from this gateway
    kv_usage: float  # 0..1, from the worker's last Stats
    tenants: TenantCounts = field(default_factory=TenantCounts)  # ``requests`` by tenant (read, never changed)


@dataclass(frozen=True)
class Placement:
    """Who asks for a worker: the tenant (cache salt) and its weight; ``near``: the worker of the same request's
    first sequence, if this is a later one; ``share``: its tier's capacity share of the admission bounds."""

    tenant: str = ""
    weight: float = 1.0
    near: str | None = None
    share: float = 1.0


def prefix_keys(cache_salt: str | None, prompt_ids: Sequence[int]) -> list[bytes]:
    keys = []
    for n in AFFINITY_PREFIXES:
        if len(prompt_ids) >= n:
            h = hashlib.blake2b(digest_size=16)
            h.update((cache_salt or "").encode() + b"\x00")
            h.update(b"".join(t.to_bytes(4, "little") for t in prompt_ids[:n]))
            keys.append(h.digest())
    return keys


def cache_key(cache_salt: str | None, prompt_cache_key: str) -> bytes:
    """The affinity key of OpenAI's ``prompt_cache_key`` within a tenant (its salt): never equal to another key."""
    return hashlib.blake2b(b"\x02cache\x00" + (cache_salt or "").encode() + b"\x00" + prompt_cache_key.encode(),
                           digest_size=16).digest()


def adapter_key(lora: str) -> bytes:
    """The affinity key of a LoRA adapter (its directory): in the map beside the prefix keys, never equal to one."""
    return hashlib.blake2b(b"\x01lora\x00" + lora.encode(), digest_size=16).digest()


def _fits(w: WorkerLoad, prompt_len: int, max_requests: float, max_prompt_tokens: float) -> bool:
    # A prompt larger than the token bound alone is still admitted to an idle worker: the bound limits
    # queueing, it must not make big (but valid) prompts impossible.
    fits_tokens = w.prompt_tokens + prompt_len <= max_prompt_tokens or w.requests == 0
    return w.requests < max_requests and fits_tokens


class Router:
    """Owns the affinity map. Call ``choose`` then, once the request is sent, ``record``."""

    def __init__(self, admission: AdmissionConfig) -> None:
        self.admission = admission
        self._affinity: OrderedDict[bytes, str] = OrderedDict()  # LRU: prefix hash -> worker id

    def can_admit(self, w: WorkerLoad, prompt_len: int, who: Placement = Placement()) -> bool:
        # The tier's bounds: floats, so that a small share of small bounds still admits to an idle worker.
        max_requests = who.share * self.admission.max_requests
        max_tokens = who.share * self.admission.max_prompt_tokens
        if _fits(w, prompt_len, max_requests, max_tokens):
            return True
        # Under its share of both bounds (a lone tenant's share is all of them: it never gets past them).
        t, tenant = w.tenants, who.tenant
        share = t.share(tenant, who.weight)
        under_share = (t.held(tenant) < share * max_requests
                       and t.held_tokens(tenant) + prompt_len <= share * max_tokens)
        return under_share and _fits(w, prompt_len, 2 * max_requests, 2 * max_tokens)

    def reserved(self, workers: Sequence[WorkerLoad], prompt_len: int, who: Placement) -> bool:
        """Whether a request no worker admits at its tier's share would get in at the bounds as configured (the
        standard tier's): it was kept out of headroom reserved for higher tiers (a 429 of its tier), not out of
        a full fleet (a 503, as before tiers; interactive's headroom past the bounds is extra)."""
        base = Placement(who.tenant, who.weight, who.near, BASE_SHARE)
        return who.share < BASE_SHARE and any(self.can_admit(w, prompt_len, base) for w in workers)

    def never_admits(self, workers: int, sequences: int, prompt_tokens: int, longest: int,
                     share: float) -> str | None:
        """Why ``workers`` idle workers could never hold a request of ``sequences`` worker requests with
        ``prompt_tokens`` prompt tokens in all (``longest``: its longest prompt) at a tier's ``share`` of the bounds,
        or None. A tenant never holds more than the bounds on a worker (its share of them is at most all), and a
        worker takes one prompt past the token bound only alone, so a worker holds at most ``share`` x
        max_requests sequences and max(``share`` x max_prompt_tokens, ``longest``) tokens of one request."""
        # an idle worker admits one request even where its share of the bound is under one (can_admit's floats)
        max_requests = max(1, math.floor(workers * share * self.admission.max_requests))
        max_tokens = workers * max(share * self.admission.max_prompt_tokens, longest)
        if sequences > max_requests:
            return (f"this request makes {sequences} sequences (prompts x best_of) and the {workers} worker(s) "
                    f"admit {max_requests} at once for its tier: send fewer prompts or sequences per request")
        if prompt_tokens > max_tokens:
            return (f"this request's sequences hold {prompt_tokens} prompt tokens (each prompt once per sequence) and "
                    f"the {workers} worker(s) admit {int(max_tokens)} at once for its tier: send fewer or shorter "
                    "prompts per request")
        return None

    def over_share(self, w: WorkerLoad, share: float) -> int:
        """How many of ``w``'s requests must end before one more of a tier with ``share`` fits its bounds (at
        least 1: a refusal by prompt tokens waits for one to end too)."""
        return max(1, w.requests + 1 - math.ceil(share * self.admission.max_requests))

    def choose(self, workers: Sequence[WorkerLoad], keys: Sequence[bytes], prompt_len: int,
               who: Placement = Placement()) -> str | None:
        """The worker to send to, or None when no worker can take the request now."""
        open_ = [w for w in workers if self.can_admit(w, prompt_len, who)]
        if not open_:
            return None
        fewest = min(w.tenants.held(who.tenant) for w in open_)
        spread = [w for w in open_ if self._spreads(w, who.tenant, fewest)]  # never empty: fewest's is in it
        least = min(spread, key=lambda w: (w.requests, w.kv_usage, w.worker_id))
        least_busy = min(w.requests for w in open_)
        by_id = {w.worker_id: w for w in open_}
        for key in keys:
            wid = self._affinity.get(key)
            if wid is None:
                continue
            w = by_id.get(wid)
            if (w is not None and w.requests - least_busy <= self.admission.affinity_slack
                    and (wid == who.near or self._spreads(w, who.tenant, fewest))):
                return wid
            break  # the longest known prefix's worker is full or too busy: balance instead
        return least.worker_id

    def _spreads(self, w: WorkerLoad, tenant: str, fewest: int) -> bool:
        """Whether one more of ``tenant``'s requests on ``w`` keeps the tenant spread within the slack."""
        held = w.tenants.held(tenant)
        return held == fewest or held - fewest < self.admission.tenant_slack

    def record(self, keys: Sequence[bytes], worker_id: str) -> None:
        for key in keys:
            self._affinity[key] = worker_id
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.admission.affinity_entries:
            self._affinity.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for key in [k for k, w in self._affinity.items() if w == worker_id]:
            del self._affinity[key]
