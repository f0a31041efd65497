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

A completions request that lists several prompts has ``best_of`` sequences per prompt, prompt by prompt; each
prompt's are ranked among themselves and its ``n`` returned ones are choices ``prompt * n ..`` (OpenAI's order).

Accounting reads a ``Choices`` as a whole: each prompt counts once, completion tokens are summed over every
sequence generated (best_of's unreturned ones too: they were computed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from gateway.base.errors import APIError
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

    def __init__(self, pool: Releaser, request_id: str, n: int = 1, best_of: int | None = None,
                 prompts: int = 1) -> None:
        self.pool = pool
        self.request_id = request_id  # the client's id; the ledger's; a worker's too when there is one sequence
        self.n = n  # choices returned per prompt
        self.best_of = best_of or n  # sequences generated per prompt
        self.prompts = prompts
        self.children: list[Child] = []  # prompt by prompt, best_of each

    @classmethod
    def single(cls, pool: Releaser, handle: RequestHandle, asm: OutputAssembler) -> Choices:
        choices = cls(pool, handle.request_id)
        choices.children.append(Child(handle, asm))
        return choices

    def child_id(self, index: int) -> str:
        return self.request_id if self.best_of * self.prompts == 1 else f"{self.request_id}-{index}"

    @property
    def num_returned(self) -> int:
        return self.n * self.prompts

    def _groups(self) -> list[list[Child]]:
        """The sequences of each prompt."""
        return [self.children[p * self.best_of:(p + 1) * self.best_of] for p in range(self.prompts)]

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
        """The sequences the client gets, in choice order: prompt by prompt, each prompt's best first when best_of
        ranked them."""
        out: list[OutputAssembler] = []
        for group in self._groups():
            asms = [c.asm for c in group]
            # stable: ties keep generation order
            out += asms if len(asms) <= self.n else sorted(asms, key=lambda a: a.cumulative_logprob,
                                                           reverse=True)[:self.n]
        return out

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
        """Prompt tokens that every sequence of a prompt found in the prefix cache, summed over the prompts (each
        prompt is billed once)."""
        return sum(min((c.asm.num_cached_tokens for c in group), default=0) for group in self._groups())

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


def prompt_text(req: GenerationRequest, tok: GatewayTokenizer) -> str:
    """The request's prompts as text, for a tenant that opted in to text logging (several: one a line)."""
    return "\n".join(tok.decode(p.ids) for p in req.prompts())


async def submit_all(pool: WorkerPool, choices: Choices, req: GenerationRequest, tok: GatewayTokenizer,
                     cache_salt: str | None, deadline: float | None, weight: float,
                     trace_context: dict[str, str] | None, *, tier: str = DEFAULT_TIER,
                     priority: int | None = None, adapter: LoraAdapterRecord | None = None) -> None:
    """Queue one worker request per sequence, one after the other (a prompt's first one's prefix affinity then draws
    the rest to its worker, ``near`` it: the router's per-tenant spread does not split one request's sequences).
    ``tier``: the class admitted (``tenancy/tiers.py``); ``priority``: what the workers get (None: the request's
    own, ``gateway.pipeline.tiering``); ``adapter``: the LoRA adapter every sequence runs with (workers are sent its
    directory). Raises what ``pool.submit`` raises; ``release_all`` aborts those queued. A request the workers
    could not hold at once even idle (many or long prompts x best_of) is a 400, before anything is queued."""
    why = pool.never_admits(req.sequences, req.prompt_tokens * choices.best_of,
                            max(len(p.ids) for p in req.prompts()), tier)
    if why is not None:  # can never fit: a 400, not a 503 its client would retry forever
        raise APIError(400, why, code="exceeds_worker_capacity")
    for p, prompt in enumerate(req.prompts()):
        for i in range(choices.best_of):
            # each prompt's sequences are drawn to where its first one went; prompts spread like requests would
            near = choices.children[p * choices.best_of].handle.worker_id if i else None
            handle = await pool.submit(choices.child_id(len(choices.children)), prompt.ids,
                                       child_sampling(req.sampling, i), cache_salt, deadline, weight, trace_context,
                                       near=near, priority=req.priority if priority is None else priority, tier=tier,
                                       lora=None if adapter is None else adapter.path,
                                       adapter=None if adapter is None else adapter.name,
                                       prompt_cache_key=req.prompt_cache_key)
            # the streamed choice index (best_of > n never streams: its indexes are the ranks)
            choices.children.append(Child(handle, OutputAssembler(tok, req.stop, req.logprobs, p * req.n + i)))
