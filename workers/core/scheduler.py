"""Continuous batching in vLLM V1's model: no prefill or decode phase, only a token budget per step.

Running requests are served first (decodes and unfinished prefill chunks), preempting the most recently
admitted request (recompute) when blocks run out; then waiting requests are admitted in weighted-fair
order, their prompts split into chunks that fit the remaining budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.core.block_manager import BlockManager
from workers.core.fair_queue import FairQueue
from workers.core.outputs import RequestTimings, SampledToken, ScheduledRequest, SchedulerOutput, StepOutput
from workers.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.bm = block_manager
        self.clock = clock  # stamps request milestones; requests' arrival_time must come from it too
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._finished_unreported: list[Request] = []  # aborted / never-fit, reported next step
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        capacity = self.bm.num_blocks * self.bm.block_size
        if req.num_prompt_tokens > req.max_total_tokens or req.num_prompt_tokens > capacity:
            # Can never fit: finish with a reason instead of stalling the queue.
            req.status = RequestStatus.FINISHED_IGNORED
            req.error = (f"prompt has {req.num_prompt_tokens} tokens, more than this worker's limit of "
                         f"{min(req.max_total_tokens, capacity)}")
            self._finished_unreported.append(req)
            return
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_ids: list[str]) -> None:
        """Idempotent; the request's blocks are free when this returns."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.bm.free(rid)
            req.status = RequestStatus.FINISHED_ABORTED
            self._finished_unreported.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_unreported)

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:  # a step that had to preempt admits nobody new
            budget = self._schedule_waiting(budget, scheduled)
        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, used, preempted)

    def _schedule_running(self, budget: int, out: list[ScheduledRequest], preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.allocate_slots(req, n):
                victim = self.running.pop()  # the most recently admitted has the least sunk work
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            out.append(ScheduledRequest(req, n, self.bm.block_table(req.request_id)))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, out: list[ScheduledRequest]) -> int:
        bs = self.bm.block_size
        now: float | None = None
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            hits = self.bm.find_cached_prefix(req)
            n = min(req.num_tokens - len(hits) * bs, budget)
            if not self.bm.allocate_slots(req, n, hits):
                break  # doesn't fit now: wait for running requests to finish (no skipping ahead)
            self.waiting.pop(req, cost_tokens=req.num_tokens - len(hits) * bs)
            self.bm.prefix_queries += req.num_tokens
            self.bm.prefix_hits += len(hits) * bs
            req.num_computed_tokens = len(hits) * bs
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits) * bs
            if req.scheduled_time is None:
                now = self.clock() if now is None else now
                req.scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append(ScheduledRequest(req, n, self.bm.block_table(req.request_id)))
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute: prompt and generated tokens are prefilled again
        req.num_preemptions += 1
        req.preempted_times.append(self.clock())
        self.num_preemptions += 1
        self.waiting.push_front(req)

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[StepOutput]:
        outputs = self.take_finished_unreported()
        now = self.clock()  # the step's results exist from here on
        for s in plan.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                raise RuntimeError(f"{req.anon_repr()} changed state while its step ran")
            samples = s.samples
            req.num_computed_tokens += s.num_new_tokens
            self.bm.cache_full_blocks(req)
            if samples and not req.output_token_ids:  # the prompt is done, counted once
                self.prompt_tokens_total += req.num_prompt_tokens
            if not samples:
                continue  # a prefill chunk that did not reach the end of the prompt
            tok = sampled[req.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_token_ids.append(tok.token_id)
            self.generation_tokens_total += 1
            status = req.check_stop(tok.token_id)
            if status is not None:
                self._finish(req, status)
            lp = [tok.logprobs] if tok.logprobs is not None else None
            timings = _timings(req, now) if status is not None else None
            outputs.append(StepOutput(req.request_id, [tok.token_id], req.status.finish_reason,
                                      req.num_cached_tokens, lp, None, timings))
        return outputs

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.running.remove(req)
        self.bm.free(req.request_id)
        del self.requests[req.request_id]

    def take_finished_unreported(self) -> list[StepOutput]:
        now = self.clock()
        out = [StepOutput(r.request_id, [], r.status.finish_reason, max(r.num_cached_tokens, 0), None, r.error,
                          _timings(r, now)) for r in self._finished_unreported]
        self._finished_unreported.clear()
        return out


def _timings(req: Request, now: float) -> RequestTimings:
    def since(t: float | None) -> float | None:
        return None if t is None else t - req.arrival_time

    return RequestTimings(since(req.scheduled_time), since(req.first_token_time), now - req.arrival_time,
                          tuple(t - req.arrival_time for t in req.preempted_times))
