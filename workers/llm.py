"""Offline API: ``LLM(...).generate(prompts, params)`` and ``LLM.chat(conversations, params)``."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from workers.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from workers.core.outputs import EngineStats, StepOutput, TokenLogprobs
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig
from workers.engine import LLMEngine
from workers.engine_build import engine_from_config

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


class LLM:
    def __init__(self, model: str = "smollm2", *, device: str = "cpu", dtype: str = "float32",
                 block_size: int = 16, kv_cache_tokens: int = 32768, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, seed: int = 0, num_threads: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto", kv_cache_bytes: int | None = None,
                 quantization: str = "auto", speculative_config: str | dict[str, Any] | None = None,
                 scheduling_policy: str = "priority", enforce_eager: bool = False, lora_dir: str | None = None,
                 max_loras: int = 8, max_cpu_loras: int | None = None,
                 background_prefill_tokens: int | None = None) -> None:
        """``speculative_config``: vLLM's shape, e.g. ``{"method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3}`` (a dict or its JSON); bad values raise ValueError. ``lora_dir``: PEFT LoRA
        adapters, one subdirectory each, that ``generate(..., lora=name)`` runs with."""
        from transformers import AutoTokenizer

        self.config = EngineConfig(
            ModelConfig(model, device, dtype, max_model_len, seed, num_threads, quantization, enforce_eager),
            CacheConfig(block_size, kv_cache_tokens, gpu_memory_utilization, enable_prefix_caching,
                        kv_cache_dtype, kv_cache_bytes),
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, _speculative(speculative_config),
                            scheduling_policy, max_loras, background_prefill_tokens),
            LoraConfig(lora_dir, max_cpu_loras))
        self.engine: LLMEngine
        self.engine, directory = engine_from_config(self.config)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(directory)
        self._ids = itertools.count()

    # ---- step-level API (what a worker process drives) ---------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    cache_salt: str | None = None, weight: float = 1.0, priority: int = 0,
                    lora: str | None = None) -> list[int]:
        ids = self.encode(prompt)
        self.engine.add_request(request_id, ids, params, cache_salt, weight, priority=priority, lora=lora)
        return ids

    def step(self) -> list[StepOutput]:
        return self.engine.step()

    def abort(self, request_ids: Sequence[str]) -> None:
        self.engine.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- batch API ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None, lora: str | Sequence[str | None] | None = None
                 ) -> list[CompletionOutput]:
        """``lora``: the adapter (under ``lora_dir``) every prompt runs with, or one per prompt (None: the base
        model). An adapter that cannot be served finishes its prompts with ``error`` set."""
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list (of strings or of token-id lists), not one string")
        plist = _broadcast(params, len(prompts))
        loras = _broadcast_lora(lora, len(prompts))
        outs: dict[str, CompletionOutput] = {}
        order: list[str] = []
        for prompt, p, name in zip(prompts, plist, loras):
            rid = f"offline-{next(self._ids)}"
            ids = self.add_request(rid, prompt, p, cache_salt, lora=name)
            outs[rid] = CompletionOutput(rid, ids, [], "", None, 0, [] if p.logprobs is not None else None)
            order.append(rid)
        for o in self._run():
            c = outs.get(o.request_id)
            if c is None:
                continue
            c.token_ids.extend(o.new_token_ids)
            if o.logprobs and c.logprobs is not None:
                c.logprobs.extend(o.logprobs)
            c.num_cached_tokens, c.finish_reason, c.error = o.num_cached_tokens, o.finish_reason, o.error
        for c in outs.values():
            c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return [outs[r] for r in order]

    def chat(self, conversations: Sequence[Sequence[dict[str, str]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             cache_salt: str | None = None, lora: str | Sequence[str | None] | None = None
             ) -> list[CompletionOutput]:
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, cache_salt, lora)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _run(self) -> Iterator[StepOutput]:
        while self.engine.has_unfinished():
            yield from self.engine.step()


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _broadcast_lora(lora: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA names for {n} prompts")
    return list(lora)


def _speculative(cfg: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    if cfg is None:
        return None
    return SpeculativeConfig.from_json(cfg if isinstance(cfg, str) else json.dumps(cfg))
