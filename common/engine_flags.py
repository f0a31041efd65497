"""The engine's command-line flags, defined once (torch-free): ``kvgate worker`` builds its parser from this table,
``kvgate serve`` its "engine" group (every default None: a flag not given is left to the worker), and
``EngineArgs`` forwards what serve was given to the workers it starts. ``OFFLINE`` names the offline ``LLM``'s
keyword for each flag; ``tests/test_engine_flags.py`` checks that every flag reaches every entry point.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from common.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto",) + DTYPES + ("int8",)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "int8-a8", "int4-a8")


def speculative_arg(text: str) -> str:
    """argparse type: a bad config is a usage error that says what is wrong, before any model loads."""
    try:
        SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclass(frozen=True)
class Flag:
    dest: str  # the namespace attribute; the flag is --dest with dashes
    type: Callable[[str], Any] | None  # None: a switch (store_true)
    default: Any  # the worker's default
    help: str = ""
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # values below are refused (a number flag)
    positive: bool = False  # strictly above minimum

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("device", str, "cpu"),
    Flag("dtype", str, "float32", choices=DTYPES),
    Flag("kv_cache_dtype", str, "auto", "auto (the model's dtype), bfloat16/float16, or int8 (per token and head "
                                        "scales, CPU only)", choices=KV_CACHE_DTYPES),
    Flag("quantization", str, "auto", "linear layers: none (fp32), int8/int4 (GGUF-style blocks, 12-bit "
                                      "activations, CPU), int8-a8/int4-a8 (8-bit activations: faster, less exact), "
                                      "auto (see README)", choices=QUANTIZATIONS),
    Flag("max_model_len", int, None, minimum=1),
    Flag("kv_cache_tokens", int, 32768, minimum=1),
    Flag("kv_cache_memory_gib", float, None, "CPU: KV capacity in GiB instead of --kv-cache-tokens (blocks "
                                             "counted in the KV dtype)", minimum=0, positive=True),
    Flag("block_size", int, 16, minimum=1),
    Flag("max_num_seqs", int, 64, minimum=1),
    Flag("max_num_batched_tokens", int, None, "tokens per engine step (default: sized at start so a step stays "
                                              "under --target-step-ms)", minimum=1),
    Flag("target_step_ms", float, None, "the step time the measured token budget aims at (default: 500 on a "
                                        "CPU, 100 on a GPU)", minimum=0, positive=True),
    Flag("no_prefix_caching", None, False, "no prefix cache: every prompt is computed"),
    Flag("enforce_eager", None, False, "CUDA: no CUDA graphs; every step runs eagerly (graphs replay pure "
                                       "decode steps, one per batch-size bucket)"),
    Flag("num_threads", int, None, "CPU: threads for the model's arithmetic (default: torch's, one per core; "
                                   "with several workers on one CPU host, give each its share)", minimum=1),
    Flag("seed", int, 0, "the engine's sampling seed for requests without one", minimum=0),
    Flag("scheduling_policy", str, "priority", "priority (default): a request's priority (lower sooner) orders the "
                                               "queue and may preempt worse-placed ones; fcfs: every request at 0",
         choices=("fcfs", "priority")),
    Flag("background_prefill_tokens", int, None, "prompt tokens a step gives requests placed below 0 (priority > 0: "
                                                 "the batch tier, Batch API lines), so a step an interactive request "
                                                 "arrives during stays short (default: a 32nd of the step "
                                                 "budget)", minimum=1),
    Flag("speculative_config", speculative_arg, None,
         'n-gram speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 3, '
         '"prompt_lookup_min": 1, "prompt_lookup_max": 3}\' (optional: disable_by_batch_size, '
         'acceptance_threshold; see README)'),
    Flag("lora_dir", str, None, "a directory of PEFT LoRA adapters, one subdirectory each; a request names one to "
                                "run with it (loaded on first use)"),
    Flag("max_loras", int, 8, "distinct LoRA adapters one engine step may run (others wait a step)", minimum=1),
    Flag("max_cpu_loras", int, None, "LoRA adapters kept loaded, least recently used evicted first (default: "
                                     "--max-loras; at least --max-loras)", minimum=1),
)
FLAGS_BY_DEST: Mapping[str, Flag] = {f.dest: f for f in ENGINE_FLAGS}

# The offline LLM's keyword for each flag (how the value converts), or why it has none.
OFFLINE: Mapping[str, str] = {
    "device": "device", "dtype": "dtype", "kv_cache_dtype": "kv_cache_dtype", "quantization": "quantization",
    "max_model_len": "max_model_len", "kv_cache_tokens": "kv_cache_tokens",
    "kv_cache_memory_gib": "kv_cache_bytes",  # x 2**30
    "block_size": "block_size", "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
    "no_prefix_caching": "enable_prefix_caching",  # negated
    "enforce_eager": "enforce_eager",
    "num_threads": "num_threads", "seed": "seed", "speculative_config": "speculative_config",
    "scheduling_policy": "scheduling_policy", "background_prefill_tokens": "background_prefill_tokens",
    "lora_dir": "lora_dir", "max_loras": "max_loras", "max_cpu_loras": "max_cpu_loras",
}
PROCESS_ONLY = {"target_step_ms": "the worker sizes its step budget at start; the offline LLM takes "
                                  "max_num_batched_tokens as given"}


def add_engine_flags(p: argparse._ActionsContainer, forwarded: bool = False) -> None:
    """The engine flags on ``p``; ``forwarded`` (kvgate serve): defaults None, so only what was given is passed
    on and the worker's own defaults apply to the rest."""
    for f in ENGINE_FLAGS:
        help_text = f.help or None
        if f.type is None:
            p.add_argument(f.option, action="store_true", help=help_text)
        else:
            p.add_argument(f.option, type=f.type, default=None if forwarded else f.default, choices=f.choices,
                           help=help_text, metavar="JSON" if f.dest == "speculative_config" else None)


def check(values: Mapping[str, Any]) -> None:
    """Range checks (ValueError naming the flag), for values that did not come through argparse."""
    for dest, v in values.items():
        f = FLAGS_BY_DEST[dest]
        if v is None or f.minimum is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v < float("inf") or v < f.minimum or (
                f.positive and v == f.minimum):
            bound = f"> {f.minimum:g}" if f.positive else f">= {f.minimum:g}"
            raise ValueError(f"{f.option} must be {bound}, got {v}")
    if values.get("speculative_config") is not None:
        SpeculativeConfig.from_json(values["speculative_config"])


def given(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine flags a (forwarded) namespace was given: not None, switches only when set."""
    values = {f.dest: getattr(ns, f.dest, None) for f in ENGINE_FLAGS}
    return {k: v for k, v in values.items() if v is not None and v is not False}  # 0 is a value (to refuse)


def argv(values: Mapping[str, Any]) -> list[str]:
    """``--flag value`` for each given value, in the table's order (switches without a value)."""
    out: list[str] = []
    for f in ENGINE_FLAGS:
        v = values.get(f.dest)
        if v is None or v is False:
            continue  # not given (a switch not set)
        out += [f.option] if f.type is None else [f.option, str(v)]
    return out
