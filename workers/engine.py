"""The step-level engine a worker process drives: add_request / abort / step / has_unfinished / stats.

``step() = schedule() -> run the model -> update_from_output()``. The engine owns the scheduler (which owns
requests and, through the block manager, their blocks) and the model runner (which owns the KV tensors). A
structured-output request whose grammar is still compiling (off this thread, ``workers.structured``) is parked
here, outside the scheduler, and joins it at the first step after its grammar is ready. How an engine is built
from a config (model files, model, KV cache, attention backend) is ``workers.engine_build``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from workers.core.outputs import EngineStats, RequestTimings, RunnerOutput, SchedulerOutput, StepOutput
from workers.core.request import Request, RequestStatus
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import Scheduler
from workers.lora import LoraRegistry, UnknownLora
from workers import structured


class Runner(Protocol):
    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...
    def release(self, request_id: str) -> None: ...
    def mask_with(self, outputs: structured.StructuredOutputs) -> None: ...


class LLMEngine:
    def __init__(self, runner: Runner, scheduler: Scheduler, vocab_size: int, eos_token_ids: Sequence[int],
                 max_model_len: int, loras: LoraRegistry | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.last_num_batched_tokens = 0  # tokens the last step() computed (prompt chunks + decodes)
        self.structured: structured.StructuredOutputs | None = None  # use_structured (structured.enable)
        self._parked: dict[str, Request] = {}  # waiting for a grammar's compile or an adapter's load, in arrival order
        self._lora_wait: dict[str, str] = {}  # parked id -> the adapter it waits for (loading beside the engine)
        self._parked_finished: list[StepOutput] = []  # parked requests aborted or refused, reported next step
        self.loras = loras  # the worker's resident LoRA adapters (None: no lora_dir)
        self._lora_of: dict[str, str] = {}  # request id -> the adapter it pins, until it finishes

    def use_structured(self, outputs: structured.StructuredOutputs) -> None:
        """Structured outputs on (``structured.enable``): grammars compile off this thread, and the runner's
        sampler masks each such request's logits row."""
        self.structured = outputs
        self.runner.mask_with(outputs)

    def set_token_budget(self, tokens: int) -> None:
        """The step's token budget (``max_num_batched_tokens``): the worker's, sized to the machine."""
        self.scheduler.set_token_budget(tokens)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    cache_salt: str | None = None, weight: float = 1.0,
                    arrival_time: float | None = None, priority: int = 0, lora: str | None = None) -> None:
        """Raises ValueError for input that is wrong (a 4xx); a prompt that can never fit, or an adapter (``lora``)
        this worker cannot serve, is accepted and finishes at the next step with an error, so the caller sees
        one uniform path."""
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id: the last is largest
            raise ValueError(f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if request_id in self.scheduler.requests or request_id in self._parked:  # before its matcher is made
            raise ValueError(f"duplicate request id {request_id!r}")
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise ValueError("priority other than 0 needs the priority scheduling policy (--scheduling-policy "
                             "priority)")
        req = Request(request_id, ids, params, cache_salt, float(weight),
                      arrival_time if arrival_time is not None else self.scheduler.clock(),
                      self.eos_token_ids, self.max_model_len, priority=int(priority), lora=lora)
        # Never blocks: a grammar not compiled yet, or an adapter not resident yet, parks the request; a malformed
        # spec raises (before the adapter is pinned: nothing to undo)
        compiling = structured.prepare(self, request_id, params)
        loading = False
        if lora is not None:
            ready = self._acquire_lora(req)
            if ready is None:
                if self.structured is not None:
                    self.structured.release(request_id)  # its compile or its matcher: nobody will use them
                return
            loading = not ready
        if compiling or loading:
            self._parked[request_id] = req  # its compile is the structured outputs' to track (compiling)
            if loading and lora is not None:
                self._lora_wait[request_id] = lora
            return
        self.scheduler.add_request(req)

    def _acquire_lora(self, req: Request) -> bool | None:
        """Pin the request's adapter (its load, if it is not resident, starts beside the engine: the registry).
        True: resident; False: loading (the request parks); None: it cannot be served, and the request finishes
        at the next step with the reason: an unknown name is ``model_not_found`` (OpenAI's code for a model that
        does not exist). A broken adapter is found by its load and refused at a later step (``_settle_loras``)."""
        name = req.lora or ""
        try:
            if self.loras is None:
                raise UnknownLora(f"LoRA adapter {name!r} requested, but this engine serves none (no lora_dir)")
            ready = self.loras.acquire(name)
        except UnknownLora as e:
            self._parked_finished.append(_finished_early(req, RequestStatus.FINISHED_IGNORED, str(e),
                                                         self.scheduler.clock(), "model_not_found"))
            return None
        self._lora_of[req.request_id] = name  # pinned: released when the request's finished output passes
        return ready

    def _release_finished(self, outputs: list[StepOutput]) -> None:
        """Finished requests give back their runner state and their pin on an adapter."""
        for o in outputs:
            if o.finished:
                self.runner.release(o.request_id)
                name = self._lora_of.pop(o.request_id, None)
                if name is not None and self.loras is not None:
                    self.loras.release(name)

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            req = self._parked.pop(rid, None)
            if req is None:
                continue
            self._lora_wait.pop(rid, None)  # its pin goes with its finished output, the load runs on
            if self.structured is not None:
                self.structured.release(rid)  # its claim on the compile: one nobody wants is not started
            self._parked_finished.append(  # reported like a queued request's abort: at the next step
                _finished_early(req, RequestStatus.FINISHED_ABORTED, None, self.scheduler.clock()))
        self.scheduler.abort(list(request_ids))
        for rid in request_ids:
            self.runner.release(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._parked) or bool(self._parked_finished)

    def step(self) -> list[StepOutput]:
        early = self._admit_parked()
        plan = self.scheduler.schedule()
        self.last_num_batched_tokens = plan.num_batched_tokens
        if plan.empty:
            outputs = early + self.scheduler.take_finished_unreported()
            if not outputs and self._parked:
                # Only compiles or loads pending: wait a little for one instead of spinning (bounded, so the
                # worker still sees its inbox: new requests, aborts)
                if self.structured is not None and self.structured.num_waiting:
                    self.structured.wait(structured.IDLE_POLL_S)
                elif self._lora_wait and self.loras is not None:
                    self.loras.wait(structured.IDLE_POLL_S)
            self._release_finished(outputs)
            return outputs
        result = self.runner.execute(plan)
        outputs = early + self.scheduler.update_from_output(plan, result.sampled, result.prompt_logprobs)
        self._release_finished(outputs)
        return outputs

    def _admit_parked(self) -> list[StepOutput]:
        """Parked requests whose grammar compiled and whose adapter is resident join the scheduler, in arrival
        order (keeping their arrival time); those refused (compile failed or too slow, adapter broken) finish
        with the reason as their error, as a prompt that can never fit does. Returns the outputs of parked
        requests that finished (refused or aborted)."""
        out, self._parked_finished = self._parked_finished, []
        if not self._parked:
            return out
        now = self.scheduler.clock()
        if self.structured is not None and self.structured.num_waiting:
            _, refused = self.structured.collect()  # the ready ones are no longer compiling
            for rid, code, why in refused:
                out.append(self._refuse_parked(rid, why, code, now))
        if self._lora_wait:
            out += self._settle_loras(now)
        compiling = self.structured.compiling if self.structured is not None else lambda rid: False
        for rid in [r for r in self._parked if not compiling(r) and r not in self._lora_wait]:
            self.scheduler.add_request(self._parked.pop(rid))
        return out

    def _settle_loras(self, now: float) -> list[StepOutput]:
        """Loads that ended: their requests may go on (once their grammar is there too), or are refused."""
        if self.loras is None:
            raise RuntimeError("requests wait on adapter loads, but this engine has no LoRA registry")
        settled = {name: self.loras.settle(name) for name in set(self._lora_wait.values())}
        out: list[StepOutput] = []
        for rid, name in list(self._lora_wait.items()):
            result = settled[name]
            if result is True:
                del self._lora_wait[rid]
            elif isinstance(result, str):
                out.append(self._refuse_parked(rid, f"LoRA adapter {name!r} cannot be loaded: {result}",
                                               "invalid_request", now))
        return out

    def _refuse_parked(self, rid: str, why: str, code: str, now: float) -> StepOutput:
        self._lora_wait.pop(rid, None)
        if self.structured is not None and self.structured.compiling(rid):
            self.structured.release(rid)  # refused for its adapter: its compile is not wanted any more
        return _finished_early(self._parked.pop(rid), RequestStatus.FINISHED_IGNORED, why, now, code)

    def warm_up(self) -> None:
        """One tiny greedy request through every path a real one takes (prefill, paged decode, sampling), so
        the first client does not pay first-call costs (kernel compilation on a GPU, allocator growth). Its
        prompt is shorter than a block, so nothing of it stays in the prefix cache; counters start at zero."""
        n = max(1, min(8, self.max_model_len - 2))
        self.add_request("warmup", [0] * n, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                         cache_salt="\0warmup")
        while self.has_unfinished():
            self.step()
        self.reset_counters()

    def reset_counters(self) -> None:
        """Start the cumulative counters (preemptions, tokens, prefix hits) from zero: after warm-up and
        probes, which are not traffic."""
        self.scheduler.reset_counters()
        self.last_num_batched_tokens = 0

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Requests run inside are not traffic (the worker's step-sizing probes, while it serves): the cumulative
        counters come back as they were, and the prefix-cache entries they made go to the front of the free
        list, the first to be evicted, rather than pushing tenants' prefixes out before them."""
        counters, cached = self.scheduler.counters(), self.scheduler.bm.cached_hashes()
        try:
            yield
        finally:
            self.scheduler.restore_counters(counters)
            self.scheduler.bm.uncache(self.scheduler.bm.cached_hashes() - cached)
            self.last_num_batched_tokens = 0

    def stats(self) -> EngineStats:
        s, bm, sc = self.scheduler, self.scheduler.bm, self.scheduler.spec_counters
        return EngineStats(bm.num_blocks, bm.num_free_blocks, bm.usage, len(s.running),
                           len(s.waiting) + len(self._parked),
                           s.num_preemptions, bm.prefix_queries, bm.prefix_hits,
                           s.prompt_tokens_total, s.generation_tokens_total, sc.num_drafts, sc.num_draft_tokens,
                           sc.num_accepted_tokens, tuple(sc.accepted_per_pos))


def _finished_early(req: Request, status: RequestStatus, error: str | None, now: float,
                    error_code: str | None = None) -> StepOutput:
    """The one output of a request that finished before the scheduler ever saw it."""
    return StepOutput(req.request_id, [], status.finish_reason, 0, None, error, RequestTimings.of(req, now),
                      error_code)
