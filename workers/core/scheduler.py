"""Continuous batching in vLLM V1's model: no prefill or decode phase, only a token budget per step.

Running requests are served first (decodes and unfinished prefill chunks), preempting the most recently
admitted request (recompute) when blocks run out; then waiting requests are admitted in weighted-fair
order, their prompts split into chunks that fit the remaining budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from workers.core.block_manager import BlockManager
from workers.core import priority
from workers.core.fair_queue import FairQueue, queue_key
from workers.core import spec_decode
from workers.core.outputs import (PromptLogprob, RequestTimings, Sampled, SampledToken, ScheduledRequest,
                                  SchedulerOutput, StepOutput, TokenLogprobs)
from workers.core.request import Request, RequestStatus
from workers.core.spec_decode import SpecCounters, SpeculativeConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    speculative: SpeculativeConfig | None = None  # n-gram speculative decoding; None: off
    policy: str = "priority"  # or "fcfs" (every request at priority 0): workers/core/priority.py
    # Distinct LoRA adapters one step may run (vLLM's max_loras; base rows do not count): a request whose adapter
    # would be one more waits for a step with room (a running one keeps its blocks, a waiting one its place)
    max_loras: int = 8
    # Prompt tokens a step gives requests placed below 0 (priority > 0: the batch tier, Batch API lines, callers
    # who asked to go later). A step is never interrupted, so an interactive arrival waits out the step under
    # way: a step full of background prompt chunks (~500 ms on a CPU) was the whole of interactive TTFT p99
    # beside a batch job (bench/RESULTS.md, issue 26). Capped, such a step stays short; their decodes are not
    # capped (one token each). None: a 32nd of max_num_batched_tokens, about 16 ms of a 500 ms CPU step
    # (measured with a 1,108-token budget, TTFT p99 beside a batch / idle: a quarter 1.4x, a sixteenth 1.3x,
    # 32 tokens 0.7x; batch output unchanged in each: a batch is decode-bound).
    background_prefill_tokens: int | None = None

    @property
    def background_budget(self) -> int:
        cap = self.background_prefill_tokens
        return max(1, self.max_num_batched_tokens // 32) if cap is None else cap

    def __post_init__(self) -> None:
        if self.policy not in priority.POLICIES:
            raise ValueError(f"scheduling policy must be one of {priority.POLICIES}, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.background_prefill_tokens is not None and self.background_prefill_tokens < 1:
            raise ValueError(f"background_prefill_tokens must be >= 1, got {self.background_prefill_tokens}")


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
        self._background_left = 0  # this step's prompt tokens still open to background requests (schedule)

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.priority != 0 and self.config.policy != "priority":
            raise ValueError("priority other than 0 needs the priority scheduling policy (--scheduling-policy "
                             "priority)")
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
        best_waiting: int | None = None
        made_room: list[str] = []
        if self.config.policy == "priority":
            self.running.sort(key=priority.running_order(self.clock()))  # stable: equal ones keep admission order
            best_waiting, made_room = self._make_room_for_the_best_waiting()
        loras: set[str] = set()  # the adapters this step runs so far
        self._background_left = self.config.background_budget
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
            n = self._background_cap(req, min(req.num_tokens - req.num_computed_tokens, budget))
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
            self._take_background(req, n)
            budget -= n
            i += 1
        return budget

    @staticmethod
    def _is_background_prefill(req: Request) -> bool:
        """A request placed below 0 with more than its next token to compute (a prompt chunk, or a recompute
        after preemption): not a decode."""
        return req.priority > 0 and req.num_tokens - req.num_computed_tokens > 1

    def _background_cap(self, req: Request, n: int) -> int:
        """``n`` tokens of ``req`` this step, cut to the background budget left where it is a background prefill
        (0: none left this step). Decodes are never cut."""
        return min(n, self._background_left) if self._is_background_prefill(req) else n

    def _take_background(self, req: Request, n: int) -> None:
        if self._is_background_prefill(req):
            self._background_left = max(0, self._background_left - n)

    def _draft(self, req: Request, budget: int) -> list[int]:
        """The n-gram draft for a decoding request, within the token budget, the context limit and its
        max_tokens (tokens past a finish would be wasted), or [] where the back-off rule says no."""
        cfg = self.config.speculative
        if cfg is None or req.params.structured is not None:
            return []
        p = req.params
        room = min(budget, req.max_total_tokens - req.num_tokens + 1) - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
        state = req.spec
        if room < 1 or not spec_decode.may_draft(state, cfg, len(self.running)):
            spec_decode.update_acceptance(state, 0, 0)
            return []
        draft = spec_decode.propose_ngram(req.all_token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                                          min(cfg.num_speculative_tokens, room))
        if not draft:
            spec_decode.update_acceptance(state, 0, 0)
        return draft

    def _inflight_prefixes(self, planned: list[ScheduledRequest]) -> set[bytes]:
        """The prompt blocks this step's running requests are computing, by content hash (one held back this
        step counts not: a request waiting for its blocks would wait on something that does not move)."""
        return {h for s in planned if s.request.num_computed_tokens < s.request.num_prompt_tokens
                for h in self.bm.uncomputed_prompt_hashes(s.request)}

    def _schedule_waiting(self, budget: int, out: list[ScheduledRequest], loras: set[str] | None = None) -> int:
        bs = self.bm.block_size
        loras = set() if loras is None else loras
        now: float | None = None
        # One prefill for one prefix: a request whose next block another request is computing waits for it (a
        # step or a few) and then hits the cache, instead of computing the same block beside it. This is what
        # makes the n choices of one request (the gateway's n / best_of, sent together) share one prefill.
        inflight = self._inflight_prefixes(out)
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
            n = self._background_cap(req, min(req.num_tokens - len(hits) * bs, budget))
            if n == 0:
                deferred.add(queue_key(req))  # no background prompt tokens left this step; other queues go on
                continue
            if not self.bm.allocate_slots(req, n, hits):
                break  # doesn't fit now: wait for running requests to finish (no skipping ahead)
            if req.lora is not None:
                loras.add(req.lora)
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
            self._take_background(req, n)
            inflight.update(self.bm.uncomputed_prompt_hashes(req))
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
                req.num_computed_tokens += s.num_new_tokens - k + accepted
                self.bm.trim(req.request_id, req.num_computed_tokens)
                self.spec_counters.record(k, accepted)
                spec_decode.update_acceptance(req.spec, k, accepted)
            else:
                req.num_computed_tokens += s.num_new_tokens
            chunk = prompt_lps.get(req.request_id) if prompt_lps else None
            if chunk is not None:
                req.prompt_lps_sent += len(chunk)
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
        if req.first_token_time is None:
            req.first_token_time = now
        new: list[int] = []
        lps: list[TokenLogprobs] = []
        status: RequestStatus | None = None
        for tok in toks:
            req.output_token_ids.append(tok.token_id)
            new.append(tok.token_id)
            if tok.logprobs is not None:
                lps.append(tok.logprobs)
            self.generation_tokens_total += 1
            status = req.check_stop(tok.token_id)
            if status is not None:
                self._finish(req, status)
                break
        timings = _timings(req, now) if status is not None else None
        return StepOutput(req.request_id, new, req.status.finish_reason, req.num_cached_tokens, lps or None, None,
                          timings, prompt_logprobs=prompt_lps)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.running.remove(req)
        self.bm.free(req.request_id)
        del self.requests[req.request_id]

    def take_finished_unreported(self) -> list[StepOutput]:
        now = self.clock()
        out = [StepOutput(r.request_id, [], r.status.finish_reason, max(r.num_cached_tokens, 0), None, r.error,
                          _timings(r, now), "context_length_exceeded" if r.error else None)
               for r in self._finished_unreported]
        self._finished_unreported.clear()
        return out


def _timings(req: Request, now: float) -> RequestTimings:
    def since(t: float | None) -> float | None:
        return None if t is None else t - req.arrival_time

    return RequestTimings(since(req.scheduled_time), since(req.first_token_time), now - req.arrival_time,
                          tuple(t - req.arrival_time for t in req.preempted_times))
