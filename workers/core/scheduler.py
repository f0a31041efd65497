"""Continuous batching in vLLM V1's model: no prefill or decode phase, only a token budget per step.

Running requests are served first (decodes and unfinished prefill chunks), preempting the most recently
admitted request (recompute) when blocks run out; then waiting requests are admitted in weighted-fair
order, their prompts split into chunks that fit the remaining budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from workers.core.block_manager import BlockManager
from workers.core import priority
from workers.core.fair_queue import FairQueue, queue_key
from workers.core import spec_decode
from workers.core.outputs import (PromptLogprob, RequestTimings, Sampled, SampledToken, ScheduledRequest,
                                  SchedulerOutput, StepOutput, TokenLogprobs)
from workers.core.request import Request, RequestStatus
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpecCounters


@dataclass(frozen=True, slots=True)
class Counters:
    """The scheduler's cumulative counters at one moment (``Scheduler.counters``)."""

    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_queries: int
    prefix_hits: int
    spec: SpecCounters


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
        self.spec_counters = SpecCounters()
        self._background = priority.BackgroundBudget()

    def set_token_budget(self, tokens: int) -> None:
        """A new step token budget (``max_num_batched_tokens``): a new frozen config, checked as any."""
        self.config = replace(self.config, max_num_batched_tokens=tokens)

    def reset_counters(self) -> None:
        """The cumulative counters (preemptions, tokens, prefix hits, drafts) from zero."""
        self.restore_counters(Counters(0, 0, 0, 0, 0, SpecCounters()))

    def counters(self) -> Counters:
        """A copy of the cumulative counters, for ``restore_counters``."""
        return Counters(self.num_preemptions, self.prompt_tokens_total, self.generation_tokens_total,
                        self.bm.prefix_queries, self.bm.prefix_hits, self.spec_counters.copy())

    def restore_counters(self, c: Counters) -> None:
        self.num_preemptions, self.prompt_tokens_total = c.num_preemptions, c.prompt_tokens_total
        self.generation_tokens_total = c.generation_tokens_total
        self.bm.restore_counters(c.prefix_queries, c.prefix_hits)
        self.spec_counters = c.spec.copy()

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.priority != 0 and self.config.policy != "priority":
            raise ValueError("priority other than 0 needs the priority scheduling policy (--scheduling-policy "
                             "priority)")
        capacity = self.bm.num_blocks * self.bm.block_size
        if req.num_prompt_tokens > req.max_total_tokens or req.num_prompt_tokens > capacity:
            req.never_fits(min(req.max_total_tokens, capacity))  # finishes with a reason, never stalls the queue
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
            req.finish(RequestStatus.FINISHED_ABORTED)
            self._finished_unreported.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._finished_unreported)

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        best_waiting: int | None = None
        made_room: list[str] = []
        if self.config.policy == "priority":
            self.running.sort(key=priority.running_order(self.clock()))  # stable: equal ones keep admission order
            best_waiting, made_room = self._make_room_for_the_best_waiting()
        loras: set[str] = set()  # the adapters this step runs so far
        self._background.start_step(self.config.background_budget)
        budget = self._schedule_running(budget, scheduled, preempted, best_waiting, loras)
        if not preempted:  # a step that had to preempt admits nobody new
            budget = self._schedule_waiting(budget, scheduled, loras)
        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, used, made_room + preempted)

    def _rank(self) -> Callable[[Request], int] | None:
        if self.config.policy != "priority":
            return None
        now = self.clock()
        return lambda r: priority.effective(r, now)

    def _make_room_for_the_best_waiting(self) -> tuple[int | None, list[str]]:
        """Priority policy: the best waiting request's level; where it finds no sequence slot or KV blocks, the
        worst running requests placed below it are preempted until it does (none of them ran this step yet)."""
        rank = self._rank()
        head = self.waiting.peek(rank=rank)
        if head is None or rank is None:
            return None, []
        level, preempted = rank(head), []
        # What its first chunk takes from the free list, its prefix hits included: a hit block no one holds is
        # in the free list too (counting only the new blocks once left it held back and never admitted)
        hits = [] if head.needs_prompt_logprobs else self.bm.find_cached_prefix(head)
        first = min(head.num_tokens - len(hits) * self.bm.block_size, self.config.max_num_batched_tokens)
        need = self.bm.free_blocks_to_allocate(head, first, hits)
        while self.running and rank(self.running[-1]) > level and (
                len(self.running) >= self.config.max_num_seqs or self.bm.num_free_blocks < need):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
        return level, preempted

    def _lora_fits(self, req: Request, loras: set[str]) -> bool:
        """Whether ``req`` may run in a step already running ``loras`` (adding its adapter to them if so)."""
        if req.lora is None or req.lora in loras:
            return True
        if len(loras) >= self.config.max_loras:
            return False
        loras.add(req.lora)
        return True

    def _schedule_running(self, budget: int, out: list[ScheduledRequest], preempted: list[str],
                          best_waiting: int | None = None, loras: set[str] | None = None) -> int:
        loras = set() if loras is None else loras
        now = self.clock()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._background.cap(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0 or priority.holds_back(req, best_waiting, now) or not self._lora_fits(req, loras):
                i += 1  # waits a step: for the better-placed arrival, room among the step's adapters, or (a
                continue  # background prompt chunk) the background budget of the next step
            draft = self._draft(req, budget) if n == 1 else []
            # A draft never preempts anyone: it runs only where its blocks are free with one block to spare
            # for every request after it (each may need a new block this step).
            spare = self.bm.num_free_blocks - self.bm.blocks_needed(len(draft)) - (len(self.running) - i)
            if draft and spare >= 0 and self.bm.allocate_slots(req, 1 + len(draft)):
                out.append(ScheduledRequest(req, 1 + len(draft), self.bm.block_table(req.request_id),
                                            tuple(draft)))
                budget -= 1 + len(draft)
                i += 1
                continue
            while not self.bm.allocate_slots(req, n):
                victim = self.running.pop()  # the most recently admitted has the least sunk work
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            out.append(ScheduledRequest(req, n, self.bm.block_table(req.request_id)))
            self._background.take(req, n)
            budget -= n
            i += 1
        return budget

    def _draft(self, req: Request, budget: int) -> list[int]:
        """The n-gram draft for a decoding request, within the token budget, the context limit and its
        max_tokens (tokens past a finish would be wasted), or [] where the back-off rule says no."""
        cfg = self.config.speculative
        if cfg is None or req.params.structured is not None:
            return []
        return spec_decode.draft(req.spec, cfg, req.draft_room(budget), len(self.running),
                                 lambda: req.all_token_ids)

    def _schedule_waiting(self, budget: int, out: list[ScheduledRequest], loras: set[str] | None = None) -> int:
        bs = self.bm.block_size
        loras = set() if loras is None else loras
        now: float | None = None
        # One prefill for one prefix: a request whose next block another request is computing waits for it (a
        # step or a few) and then hits the cache, instead of computing the same block beside it. This is what
        # makes the n choices of one request (the gateway's n / best_of, sent together) share one prefill.
        # (Only this step's running requests count: one held back would be waited on without moving.)
        inflight = self.bm.prompt_blocks_in_flight(s.request for s in out)
        deferred: set[tuple[str, int]] = set()  # queues whose head waits this step (the rest go on)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek(deferred, self._rank())
            if req is None:
                break
            hits = [] if req.needs_prompt_logprobs else self.bm.find_cached_prefix(req)
            nxt = None if req.needs_prompt_logprobs else self.bm.next_uncached_hash(req, len(hits))
            if nxt is not None and nxt in inflight:
                deferred.add(queue_key(req))
                continue
            if req.lora is not None and req.lora not in loras and len(loras) >= self.config.max_loras:
                deferred.add(queue_key(req))  # its adapter would be one too many this step; other queues go on
                continue
            n = self._background.cap(req, min(req.num_tokens - len(hits) * bs, budget))
            if n == 0:
                deferred.add(queue_key(req))  # no background prompt tokens left this step; other queues go on
                continue
            if not self.bm.allocate_slots(req, n, hits):
                break  # doesn't fit now: wait for running requests to finish (no skipping ahead)
            if req.lora is not None:
                loras.add(req.lora)
            self.waiting.pop(req, cost_tokens=req.num_tokens - len(hits) * bs)
            self.bm.count_prefix_lookup(req.num_tokens, len(hits) * bs)
            if now is None and req.scheduled_time is None:  # the clock is read once a call, when needed
                now = self.clock()
            req.start(len(hits) * bs, now)
            self.running.append(req)
            out.append(ScheduledRequest(req, n, self.bm.block_table(req.request_id)))
            self._background.take(req, n)
            inflight.update(self.bm.uncomputed_prompt_hashes(req))
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.request_id)
        req.preempt(self.clock())
        self.num_preemptions += 1
        self.waiting.push_front(req)

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, sampled: Mapping[str, Sampled],
                           prompt_lps: Mapping[str, list[PromptLogprob]] | None = None) -> list[StepOutput]:
        """``sampled``: per request that sampled, its token, or (with a draft) the accepted draft tokens and the
        model's own token after them. ``prompt_lps``: per request that asked, the prompt logprobs of the
        positions this step computed; they go out in this step's output of the request (one of their own when
        the chunk sampled nothing), so no output carries more than the step's token budget of them."""
        outputs = self.take_finished_unreported()
        now = self.clock()  # the step's results exist from here on
        for s in plan.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                raise RuntimeError(f"{req.anon_repr()} changed state while its step ran")
            samples = s.samples
            k = len(s.spec_token_ids)
            got = sampled[req.request_id] if samples else None
            toks = [got] if isinstance(got, SampledToken) else list(got or [])
            if k:  # only the accepted draft tokens' K/V are valid; the rest of the slots are rolled back
                accepted = len(toks) - 1
                if not 0 <= accepted <= k or [t.token_id for t in toks[:accepted]] != list(s.spec_token_ids[:accepted]):
                    raise RuntimeError(f"{req.anon_repr()}: {len(toks)} tokens for a draft of {k}")
                req.computed(s.num_new_tokens - k + accepted)
                self.bm.trim(req.request_id, req.num_computed_tokens)
                self.spec_counters.record(k, accepted)
                spec_decode.update_acceptance(req.spec, k, accepted)
            else:
                req.computed(s.num_new_tokens)
            chunk = prompt_lps.get(req.request_id) if prompt_lps else None
            if chunk is not None:
                req.sent_prompt_logprobs(len(chunk))
            self.bm.cache_full_blocks(req)
            if samples and not req.output_token_ids:  # the prompt is done, counted once
                self.prompt_tokens_total += req.num_prompt_tokens
            if samples:
                outputs.append(self._append(req, toks, now, chunk))
            elif chunk:  # a prefill chunk that did not reach the end of the prompt: only its prompt logprobs
                outputs.append(StepOutput(req.request_id, [], None, req.num_cached_tokens, prompt_logprobs=chunk))
        return outputs

    def _append(self, req: Request, toks: list[SampledToken], now: float,
                prompt_lps: list[PromptLogprob] | None) -> StepOutput:
        """Append the step's tokens until one finishes the request (the rest of an accepted run is dropped);
        ``prompt_lps``: those of the prompt chunk this step computed (its last), when asked for."""
        new: list[int] = []
        lps: list[TokenLogprobs] = []
        status: RequestStatus | None = None
        for tok in toks:
            status = req.append_token(tok.token_id, now)
            new.append(tok.token_id)
            if tok.logprobs is not None:
                lps.append(tok.logprobs)
            self.generation_tokens_total += 1
            if status is not None:
                self._finish(req, status)
                break
        timings = RequestTimings.of(req, now) if status is not None else None
        return StepOutput(req.request_id, new, req.status.finish_reason, req.num_cached_tokens, lps or None, None,
                          timings, prompt_logprobs=prompt_lps)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.finish(status)
        self.running.remove(req)
        self.bm.free(req.request_id)
        del self.requests[req.request_id]

    def take_finished_unreported(self) -> list[StepOutput]:
        now = self.clock()
        out = [StepOutput(r.request_id, [], r.status.finish_reason, max(r.num_cached_tokens, 0), None, r.error,
                          RequestTimings.of(r, now), "context_length_exceeded" if r.error else None)
               for r in self._finished_unreported]
        self._finished_unreported.clear()
        return out

