"""The step-level engine a worker process drives: add_request / abort / step / has_unfinished / stats.

``step() = schedule() -> run the model -> update_from_output()``. The engine owns the scheduler (which owns
requests and, through the block manager, their blocks) and the model runner (which owns the KV tensors). A
structured-output request whose grammar is still compiling (off this thread, ``workers.structured``) is parked
here, outside the scheduler, and joins it at the first step after its grammar is ready.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from kernels_cupy.interface import AttentionBackend
from workers.config import CacheConfig, EngineConfig
from workers.core.block_manager import BlockManager
from workers.core.outputs import EngineStats, RequestTimings, RunnerOutput, SchedulerOutput, StepOutput
from workers.core.request import Request, RequestStatus
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import Scheduler, SchedulerConfig
from workers.lora import LoraRegistry, UnknownLora
from workers.model_runner import ModelRunner, kv_cache_bytes_per_block
from workers import structured
from common.startup import StartupProgress
from workers.models.linear import BlockLinear
from workers.models.llama import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}  # int8: codes + per-row scales (kernels_cupy.kv_quant)


class Runner(Protocol):
    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...
    def release(self, request_id: str) -> None: ...


class LLMEngine:
    def __init__(self, runner: Runner, scheduler: Scheduler, vocab_size: int, eos_token_ids: Sequence[int],
                 max_model_len: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.last_num_batched_tokens = 0  # tokens the last step() computed (prompt chunks + decodes)
        self.structured: structured.StructuredOutputs | None = None  # set by structured.enable
        self._parked: dict[str, Request] = {}  # waiting for their grammar's compile, in arrival order
        self._parked_finished: list[StepOutput] = []  # parked requests aborted or refused, reported next step
        self.loras: LoraRegistry | None = None  # set by engine_from_model: the worker's resident LoRA adapters
        self._lora_of: dict[str, str] = {}  # request id -> the adapter it pins, until it finishes

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
        if lora is not None and not self._acquire_lora(req):
            return
        # Never blocks: a grammar not compiled yet parks the request; a malformed spec raises
        if structured.prepare(self, request_id, params):
            self._parked[request_id] = req
            return
        self.scheduler.add_request(req)

    def _acquire_lora(self, req: Request) -> bool:
        """Load (if not resident) and pin the request's adapter, here at the step boundary, never in a step.
        False: it cannot be served, and the request finishes at the next step with the reason: an unknown name
        is ``model_not_found`` (OpenAI's code for a model that does not exist), a broken adapter
        ``invalid_request``."""
        name = req.lora or ""
        try:
            if self.loras is None:
                raise UnknownLora(f"LoRA adapter {name!r} requested, but this engine serves none (no lora_dir)")
            self.loras.acquire(name)
        except UnknownLora as e:
            self._parked_finished.append(_finished_early(req, RequestStatus.FINISHED_IGNORED, str(e),
                                                         self.scheduler.clock(), "model_not_found"))
            return False
        except ValueError as e:
            self._parked_finished.append(_finished_early(req, RequestStatus.FINISHED_IGNORED,
                                                         f"LoRA adapter {name!r} cannot be loaded: {e}",
                                                         self.scheduler.clock(), "invalid_request"))
            return False
        self._lora_of[req.request_id] = name
        return True

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
            if not outputs and self._parked and self.structured is not None:
                # Only compiles pending: wait a little for one instead of spinning (bounded, so the worker
                # still sees its inbox: new requests, aborts)
                self.structured.wait(structured.IDLE_POLL_S)
            self._release_finished(outputs)
            return outputs
        result = self.runner.execute(plan)
        outputs = early + self.scheduler.update_from_output(plan, result.sampled, result.prompt_logprobs)
        self._release_finished(outputs)
        return outputs

    def _admit_parked(self) -> list[StepOutput]:
        """Parked requests whose grammar compiled join the scheduler (keeping their arrival time); those
        refused (compile failed or too slow) finish with the reason as their error, as a prompt that can never
        fit does. Returns the outputs of parked requests that finished (refused or aborted)."""
        out, self._parked_finished = self._parked_finished, []
        if not self._parked or self.structured is None:
            return out
        ready, refused = self.structured.collect()
        for rid in ready:
            self.scheduler.add_request(self._parked.pop(rid))
        now = self.scheduler.clock()
        for rid, code, why in refused:
            out.append(_finished_early(self._parked.pop(rid), RequestStatus.FINISHED_IGNORED, why, now, code))
        return out

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
        s, bm = self.scheduler, self.scheduler.bm
        s.num_preemptions = s.prompt_tokens_total = s.generation_tokens_total = 0
        bm.prefix_queries = bm.prefix_hits = 0
        s.spec_counters.reset()
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
    return StepOutput(req.request_id, [], status.finish_reason, 0, None, error,
                      RequestTimings(None, None, now - req.arrival_time), error_code)


def num_kv_blocks(cache: CacheConfig, device: torch.device, bytes_per_block: int) -> int:
    """CPU: the configured byte budget (kv_cache_bytes) or else token budget. CUDA: a share of the free memory
    after the weights loaded. Bytes are counted in the cache's own dtype (int8 with its scales)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(free * cache.gpu_memory_utilization) // bytes_per_block)
    if cache.kv_cache_bytes is not None:
        return max(1, cache.kv_cache_bytes // bytes_per_block)
    return cache.kv_cache_tokens // cache.block_size


def default_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from kernels_cupy import cuda_backend_or_reference  # CuPy kernels, or the reference (logged)

        return cuda_backend_or_reference(device)
    from kernels_cupy.cpu import cpu_backend_or_reference

    return cpu_backend_or_reference()  # type: ignore[no-any-return]


def resolve_kv_dtype(cfg: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> torch.dtype:
    """``kv_cache_dtype`` as a torch dtype. ``auto``: the model's dtype, except for a block-quantized model in
    float32 on the CPU, which caches fp16 rows: the CPU kernels widen them exactly (F16C), decode attention reads
    half the bytes (it is bound by them), and a token budget holds twice the tokens. Quality gate with it
    (bench/RESULTS.md): int4 + fp16 KV 100% top-1 agreement with fp32 of the same weights, perplexity -0.006%.
    ``none`` (the exact fp32 reference mode) keeps an fp32 cache."""
    if cfg.cache.kv_cache_dtype != "auto":
        return _KV_DTYPES[cfg.cache.kv_cache_dtype]
    if device.type == "cpu" and cfg.model.dtype == "float32" and any(isinstance(m, BlockLinear)
                                                                     for m in model.modules()):
        return torch.float16
    return _KV_DTYPES[cfg.model.dtype]


MAX_GRAPH_BATCH = 512  # the largest captured decode batch; larger decode steps run eagerly


def engine_from_model(model: LlamaForCausalLM, cfg: EngineConfig, max_len: int) -> LLMEngine:
    """Wrap an already built model (tests use tiny random ones) in a full engine."""
    device = next(model.parameters()).device
    kv_dtype = resolve_kv_dtype(cfg, model, device)
    block_bytes = kv_cache_bytes_per_block(model, cfg.cache.block_size, kv_dtype)
    nb = num_kv_blocks(cfg.cache, device, block_bytes)
    runner = ModelRunner(model, nb, cfg.cache.block_size, default_backend(device), device, kv_dtype,
                         cfg.model.seed)
    bm = BlockManager(nb, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
    # A lone request must always fit in the cache, so the context limit is capped by the KV capacity.
    max_model_len = min(max_len, nb * cfg.cache.block_size)
    if device.type == "cuda" and not cfg.model.enforce_eager:
        runner.enable_cuda_graphs(max_model_len, min(cfg.scheduler.max_num_seqs, MAX_GRAPH_BATCH))
    log.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB; max_model_len %d", nb, cfg.cache.block_size,
             str(kv_dtype).removeprefix("torch."), nb * block_bytes / 2**20, max_model_len)
    engine = LLMEngine(runner, Scheduler(cfg.scheduler, bm), model.cfg.vocab_size, model.cfg.eos_token_ids,
                       max_model_len)
    if cfg.lora.lora_dir is not None:
        engine.loras = runner.loras = LoraRegistry(Path(cfg.lora.lora_dir), model.cfg, cfg.max_cpu_loras, device)
    return engine


def resolve_max_model_len(llama_cfg: LlamaConfig, requested: int | None) -> int:
    """The context limit before the KV cache caps it: the requested one, else the model's own. A model with a
    sliding window (Mistral 7B v0.1) is capped at it: sliding-window attention is not implemented, and a context
    that fits the window sees exactly what full attention sees, so within it the output is the model's own."""
    max_len = requested or llama_cfg.max_position_embeddings
    if max_len > llama_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's {llama_cfg.max_position_embeddings}")
    window = llama_cfg.sliding_window
    if window is None or max_len <= window:
        return max_len
    if requested is not None:
        raise ValueError(f"max_model_len {requested} exceeds the model's sliding_window {window}; sliding-window "
                         f"attention is not implemented, so the context is limited to the window: use "
                         f"--max-model-len {window} or less")
    log.info("max_model_len capped at the model's sliding_window %d (sliding-window attention is not "
             "implemented; within the window it equals full attention)", window)
    return window


def build_model(llama_cfg: LlamaConfig, state_dict: dict[str, torch.Tensor] | None,
                cfg: EngineConfig, gguf: Path | None = None) -> tuple[LlamaForCausalLM, int]:
    """The model with ``cfg.model.quantization`` applied (``gguf``: the source file, whose own quantized
    blocks the quantized modes keep)."""
    from workers.models.loader import apply_quantization, build_model as _build

    if cfg.model.num_threads:
        torch.set_num_threads(cfg.model.num_threads)
    max_len = resolve_max_model_len(llama_cfg, cfg.model.max_model_len)
    model = _build(llama_cfg, state_dict, max_len, _DTYPES[cfg.model.dtype], torch.device(cfg.model.device))
    log.info("linear layers: %s", apply_quantization(model, cfg.model, gguf))
    return model, max_len


def engine_from_config(cfg: EngineConfig, progress: StartupProgress | None = None) -> tuple[LLMEngine, Path]:
    """Resolve, load, wrap and warm up the configured model; returns the engine and the model's directory."""
    from workers.model_files import gguf_source, resolve
    from workers.models.loader import load_state_dict, read_config

    progress = progress or StartupProgress("engine")
    with progress.step(f"resolving model {cfg.model.model} (a GGUF converts once)"):
        files = resolve(cfg.model.model)
    with progress.step("loading weights"):
        llama_cfg = LlamaConfig.from_hf(read_config(files.directory))
        state_dict = load_state_dict(files.directory)
    with progress.step(f"building the model ({cfg.model.dtype}, {cfg.model.device})"):
        model, max_len = build_model(llama_cfg, state_dict, cfg, gguf_source(cfg.model.model))
    with progress.step("allocating the KV cache and loading attention kernels"):
        engine = engine_from_model(model, cfg, max_len)
    with progress.step("warming up"):
        engine.warm_up()
    structured.enable(engine, files.directory)  # the grammar engine loads the tokenizer at first use
    return engine, files.directory


__all__ = ["LLMEngine", "SchedulerConfig", "build_model", "engine_from_config", "engine_from_model"]
