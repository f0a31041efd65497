"""Engine command-line knobs shared by ``kvgate worker`` and ``kvgate serve`` (which forwards them)."""

from __future__ import annotations

import argparse

from workers.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, ModelConfig
from workers.core.scheduler import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine knobs shared by ``kvgate worker`` and ``kvgate serve``."""
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or safetensors directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (the model's dtype), bfloat16/float16, or int8 (per token and head scales, CPU only)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "int8-a8", "int4-a8"],
                   help="linear layers: none (fp32), int8/int4 (GGUF-style blocks, 12-bit activations, CPU), "
                        "int8-a8/int4-a8 (8-bit activations: faster, less exact), auto (see README)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="CPU: KV capacity in GiB instead of --kv-cache-tokens (blocks counted in the KV dtype)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (default: sized at start so a step stays under --target-step-ms)")
    p.add_argument("--target-step-ms", type=float, default=None,
                   help="the step time the measured token budget aims at (default: 500 on a CPU, 100 on a GPU)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU: threads for the model's arithmetic (default: torch's, one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None, metavar="JSON", type=speculative_arg,
                   help='n-gram speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": '
                        '3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}\' (optional: disable_by_batch_size, '
                        'acceptance_threshold; see docs/ARCHITECTURE.md)')


def speculative_arg(text: str) -> SpeculativeConfig:
    """argparse type: a bad config is a usage error that says what is wrong, before the model loads."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gib_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if not 0 < gib < float("inf"):
        raise ValueError(f"--kv-cache-memory-gib must be a number > 0, got {gib}")
    return int(gib * 2**30)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine's config; with no --max-num-batched-tokens the worker replaces 512 by a measured budget."""
    target = getattr(a, "target_step_ms", None)
    if target is not None and not 0 < target < float("inf"):
        raise ValueError(f"--target-step-ms must be a number > 0, got {target}")
    budget = a.max_num_batched_tokens
    threads = getattr(a, "num_threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {threads}")
    speculative: SpeculativeConfig | None = getattr(a, "speculative_config", None)
    return EngineConfig(ModelConfig(a.model, a.device, a.dtype, a.max_model_len, a.seed, threads,
                                    quantization=getattr(a, "quantization", "auto")),
                        CacheConfig(a.block_size, a.kv_cache_tokens, 0.9, not a.no_prefix_caching, a.kv_cache_dtype,
                                    _gib_bytes(getattr(a, "kv_cache_memory_gib", None))),
                        SchedulerConfig(a.max_num_seqs, 512 if budget is None else budget, speculative))
