"""``kvgate worker``'s engine flags: the table in ``common.engine_flags`` (``kvgate serve`` forwards the same
flags), plus the worker's own ``--model`` and ``--served-model-name``; and the engine config they make."""

from __future__ import annotations

import argparse

from common.engine_flags import add_engine_flags, check, given
from workers.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags of ``kvgate worker`` (and the offline CLI)."""
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or safetensors directory")
    p.add_argument("--served-model-name", default=None)
    add_engine_flags(p)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine's config; with no --max-num-batched-tokens the worker replaces 512 by a measured budget.
    Raises ValueError naming a flag whose value is out of range."""
    check(given(a))
    budget = a.max_num_batched_tokens
    gib = a.kv_cache_memory_gib
    speculative = None if a.speculative_config is None else SpeculativeConfig.from_json(a.speculative_config)
    return EngineConfig(ModelConfig(a.model, a.device, a.dtype, a.max_model_len, a.seed, a.num_threads,
                                    quantization=a.quantization, enforce_eager=a.enforce_eager),
                        CacheConfig(a.block_size, a.kv_cache_tokens, 0.9, not a.no_prefix_caching, a.kv_cache_dtype,
                                    None if gib is None else int(gib * 2**30)),
                        SchedulerConfig(a.max_num_seqs, 512 if budget is None else budget, speculative,
                                        a.scheduling_policy, a.max_loras, a.background_prefill_tokens),
                        LoraConfig(a.lora_dir, a.max_cpu_loras))
