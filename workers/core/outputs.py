"""Typed results of the engine core: what the scheduler plans, what the runner samples, what a step
reports back (one StepOutput per request that produced something or finished)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.messages import PromptLogprob as PromptLogprob  # per prompt token after the first: (logprob, rank, top-N)
from workers.core.request import Request

# One logprobs entry per sampled token: (logprob of the sampled token, [(token id, logprob), ...top-N])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    block_table: list[int]  # the block manager's live table for the request (read-only for the runner)
    # Speculative decoding: drafted tokens appended after the request's last token, counted in num_new_tokens
    spec_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so a new token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(self.spec_token_ids)

    def input_token_ids(self) -> list[int]:
        """The step's query tokens: the next uncomputed ones, then the draft (if any)."""
        start = self.request.num_computed_tokens
        k = len(self.spec_token_ids)
        ids = self.request.tokens_in(start, start + self.num_new_tokens - k)
        return ids + list(self.spec_token_ids) if k else ids


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # batch order: running requests first, then newly admitted
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


# What the runner returns per sampled request: one token, or (a request with a draft) the accepted draft
# tokens followed by the model's own token.
Sampled = SampledToken | list[SampledToken]


@dataclass(frozen=True)
class RunnerOutput:
    """What the model runner returns for a step."""

    sampled: dict[str, Sampled]  # per request that reached its last token
    # per request computing prompt logprobs: those of the prompt positions this step computed, in order
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request spent its time in the engine, in seconds since it arrived there. Offsets, not
    timestamps: whoever reads them need not share the engine's clock."""

    scheduled: float | None  # first admitted to a batch; None if it never ran (aborted while queued)
    first_token: float | None
    finished: float
    preempted: tuple[float, ...] = ()

    @classmethod
    def of(cls, req: Request, now: float) -> RequestTimings:
        """``req``'s milestones as offsets from its arrival, finished at ``now``."""
        def since(t: float | None) -> float | None:
            return None if t is None else t - req.arrival_time

        return cls(since(req.scheduled_time), since(req.first_token_time), now - req.arrival_time,
                   tuple(t - req.arrival_time for t in req.preempted_times))


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # set when the request could never run (a 4xx for the client)
    timings: RequestTimings | None = None  # set on the request's last output only
    error_code: str | None = None  # with error: the OpenAI error code (ipc.messages.RequestOutputMsg)
    # When asked for: those of the prompt positions this step computed (a prefill chunk's), in order; an output
    # with no token may carry only these
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    kv_usage: float
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_queries: int  # tokens
    prefix_hits: int  # tokens
    prompt_tokens_total: int
    generation_tokens_total: int
    # speculative decoding (vLLM's spec_decode counters), cumulative; zeros when it is off
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
