"""A request's state inside the engine. The scheduler owns the Request objects and moves them through their
states with the methods below (never by writing their fields); the block manager owns their blocks (keyed by
request id)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from workers.core.sampling_params import SamplingParams
from workers.core.spec_decode import SpecState


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6  # can never fit (prompt longer than the context or the whole KV cache)

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason. A request that could never fit reports "length" plus an error."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    weight: float = 1.0
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 0  # prompt + output may not exceed this (the context limit)
    priority: int = 0  # lower runs sooner, under the priority policy (workers/core/priority.py)
    lora: str | None = None  # the LoRA adapter its rows run with (None: the base model); part of its prefix key

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (cached or computed)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    num_preemptions: int = 0
    error: str | None = None  # why a FINISHED_IGNORED request could never run
    # Milestones on the scheduler's clock (the same clock as arrival_time), for queue/prefill/decode metrics.
    scheduled_time: float | None = None  # first admitted to a batch; a preempted request keeps its first
    first_token_time: float | None = None
    preempted_times: list[float] = field(default_factory=list)
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding: draft and acceptance EMA
    # Prompt positions whose logprobs went out (each step's output carries its chunk's): a recompute after a
    # preemption computes the rest only, so the gateway never gets a position twice
    prompt_lps_sent: int = 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for and not all delivered: every prompt position must be computed (no prefix-cache hit); a
        recompute after preemption once they were all sent does not compute them again."""
        return self.params.prompt_logprobs is not None and self.prompt_lps_sent < self.num_prompt_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_in(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, copying only that range (a decode asks for one token
        every step; concatenating the whole sequence for it would cost O(context) per step)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def draft_room(self, budget: int) -> int:
        """Tokens a speculative draft may add after this decoding request's next one: within the step's token
        ``budget``, the context limit and max_tokens (tokens past a finish would be wasted)."""
        room = min(budget, self.max_total_tokens - self.num_tokens + 1) - 1
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - len(self.output_token_ids) - 1)
        return room

    # ---- transitions (the scheduler's) ----------------------------------------------------------
    def never_fits(self, limit: int) -> None:
        """Finished before it ran: its prompt is over ``limit`` tokens (the context or the whole KV cache)."""
        self.status = RequestStatus.FINISHED_IGNORED
        self.error = f"prompt has {self.num_prompt_tokens} tokens, more than this worker's limit of {limit}"

    def start(self, hit_tokens: int, now: float | None) -> None:
        """Admitted to a batch, its first ``hit_tokens`` found in the prefix cache. ``now`` (needed only at its
        first admission: a preempted request keeps its first time and its first hit count)."""
        self.num_computed_tokens = hit_tokens
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = hit_tokens
        if self.scheduled_time is None:
            self.scheduled_time = now
        self.status = RequestStatus.RUNNING

    def preempt(self, now: float) -> None:
        """Out of the batch, its blocks freed: prompt and generated tokens are computed again (recompute)."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        self.preempted_times.append(now)

    def computed(self, num_tokens: int) -> None:
        """A step computed (and kept the K/V of) ``num_tokens`` more of its tokens."""
        self.num_computed_tokens += num_tokens

    def sent_prompt_logprobs(self, num_positions: int) -> None:
        self.prompt_lps_sent += num_positions

    def append_token(self, token_id: int, now: float) -> RequestStatus | None:
        """A sampled token joins the output; returns the finished status it causes, or None to go on."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)
        return self.check_stop(token_id)

    def finish(self, status: RequestStatus) -> None:
        self.status = status

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """Called after ``token_id`` was appended. Returns the finished status, or None to go on."""
        n_out = len(self.output_token_ids)
        p = self.params
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def anon_repr(self) -> str:
        """For logs: lengths and state, never the tokens themselves."""
        return (f"Request(id={self.request_id}, prompt_len={self.num_prompt_tokens}, lora={self.lora is not None}, "
                f"out_len={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"status={self.status.name})")
