"""The sequences of one request: its ``n`` choices (``best_of`` candidates when that is larger), each a worker
request of its own.

As in vLLM V1, a request for several sequences fans out at the gateway: one ``Generate`` per sequence, same prompt,
so a worker needs no notion of siblings. They share the prompt's KV blocks through the worker's tenant-scoped
prefix cache when they land on one worker, which the router's prefix affinity (cache salt + prompt,
``gateway/fleet/routing.py``) does for a prompt long enough to be keyed, unless that worker is much busier than
the least loaded one (its spread of each tenant's requests over the workers does not split them); otherwise they
spread like separate requests would.

Seeds: sequence ``i`` samples with ``seed + i`` (mod 2**63, the wire's range), so a seeded request is reproducible
choice by choice and its choice ``i`` is what the same request with ``n: 1`` and ``seed + i`` returns. Without a
seed the sequences draw from the worker's shared generator and differ; greedy ones are identical (as OpenAI's).

Ranking: when ``best_of > n`` the ``n`` sequences with the highest cumulative logprob (the sum of their kept
tokens' logprobs) are returned, best first (ties in generation order); otherwise all, in generation order.

Accounting reads a ``Choices`` as a whole: the prompt counts once, completion tokens are summed over every
sequence generated (best_of's unreturned ones too: they were computed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from gateway.base.handle import RequestHandle
from gateway.pipeline.generation import OutputAssembler
from gateway.pipeline.protocol import GenerationRequest
from gateway.pipeline.tokenizer import GatewayTokenizer
from ipc.messages import EngineTimings
from ipc.sampling import SamplingParams
from tenancy.models import LoraAdapterRecord
from tenancy.tiers import DEFAULT_TIER

if TYPE_CHECKING:
    from gateway.fleet.pool import WorkerPool

SEED_MODULUS = 2**63  # SamplingParams takes seeds in [0, 2**63): derived seeds wrap around inside it


def child_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) % SEED_MODULUS


def child_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=child_seed(sampling.seed, index))


class Releaser(Protocol):
    """What ends a worker request (``WorkerPool.release``: aborts it on its worker unless it finished)."""

    def release(self, handle: RequestHandle) -> None: ...


@dataclass
class Child:
    handle: RequestHandle
    asm: OutputAssembler


class Choices:
    """One request's sequences; ``release_all`` (sync, idempotent) in the ``finally`` of whoever owns them."""

    def __init__(self, pool: Releaser, request_id: str, n: int = 1, best_of: int | None = None) -> None:
        self.pool = pool
        self.request_id = request_id  # the client's id; the ledger's; a worker's too when there is one sequence
        self.n = n
        self.best_of = best_of or n
        self.children: list[Child] = []

    @classmethod
    def single(cls, pool: Releaser, handle: RequestHandle, asm: OutputAssembler) -> Choices:
        choices = cls(pool, handle.request_id)
        choices.children.append(Child(handle, asm))
        return choices

    def child_id(self, index: int) -> str:
        return self.request_id if self.best_of == 1 else f"{self.request_id}-{index}"

    def release(self, child: Child) -> None:
        self.pool.release(child.handle)

    def release_all(self) -> None:
        for child in self.children:
            self.pool.release(child.handle)

    @property
    def worker_id(self) -> str | None:
        """The first sequence's worker (the one metrics and the trace name; the others are usually the same)."""
        return self.children[0].handle.worker_id if self.children else None

    @property
    def finished(self) -> bool:
        return bool(self.children) and all(c.asm.finished for c in self.children)

    def returned(self) -> list[OutputAssembler]:
        """The sequences the client gets, in choice order (best first when best_of ranked them)."""
        asms = [c.asm for c in self.children]
        if len(asms) <= self.n:
            return asms
        return sorted(asms, key=lambda a: a.cumulative_logprob, reverse=True)[:self.n]  # stable: ties keep order

    # ---- what accounting and tracing read (OutputAssembler's names, over every sequence) ------------------

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.asm.token_ids) for c in self.children)

    @property
    def generated_tokens(self) -> int:
        """Tokens the workers generated for every sequence, taken by the client or not: what a request that did
        not complete is billed (one cut for a slow reader generated more than its client took)."""
        return sum(max(len(c.asm.token_ids), c.handle.generated_tokens) for c in self.children)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens that every sequence found in the prefix cache (the prompt is billed once)."""
        return min((c.asm.num_cached_tokens for c in self.children), default=0)

    @property
    def first_token_at(self) -> float | None:
        return min((t for c in self.children if (t := c.asm.first_token_at) is not None), default=None)

    @property
    def finish_reason(self) -> str | None:
        """The first returned choice's (the request's status in the ledger, as with one choice)."""
        returned = self.returned()
        return returned[0].finish_reason if returned else None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [a.finish_reason for a in self.returned()]

    @property
    def hit_stop_string(self) -> bool:
        return any(c.asm.hit_stop_string for c in self.children)

    @property
    def engine_timings(self) -> EngineTimings | None:
        return self.children[0].asm.engine_timings if self.children else None

    @property
    def engine_timings_at(self) -> float | None:
        return self.children[0].asm.engine_timings_at if self.children else None

    @property
    def texts(self) -> list[str]:
        return [a.text for a in self.returned()]


async def submit_all(pool: WorkerPool, choices: Choices, req: GenerationRequest, tok: GatewayTokenizer,
                     cache_salt: str | None, deadline: float | None, weight: float,
                     trace_context: dict[str, str] | None, *, tier: str = DEFAULT_TIER,
                     priority: int | None = None, adapter: LoraAdapterRecord | None = None) -> None:
    """Queue one worker request per sequence, one after the other (the first one's prefix affinity then draws the
    rest to its worker, ``near`` it: the router's per-tenant spread does not split one request's sequences).
    ``tier``: the class admitted (``tenancy/tiers.py``); ``priority``: what the workers get (None: the request's
    own, ``gateway.pipeline.tiering``); ``adapter``: the LoRA adapter every sequence runs with (workers are sent its
    directory). Raises what ``pool.submit`` raises; ``release_all`` aborts those queued."""
    for i in range(choices.best_of):
        handle = await pool.submit(choices.child_id(i), req.prompt_ids, child_sampling(req.sampling, i), cache_salt,
                                   deadline, weight, trace_context, near=choices.worker_id,
                                   priority=req.priority if priority is None else priority, tier=tier,
                                   lora=None if adapter is None else adapter.path,
                                   adapter=None if adapter is None else adapter.name)
        choices.children.append(Child(handle, OutputAssembler(tok, req.stop, req.logprobs, i)))
