"""Size the engine's step to the machine: measure prefill speed at start-up, pick the token budget.

One engine step computes up to ``max_num_batched_tokens`` tokens (decodes first, then prefill chunks), and
every running stream waits for the whole step before its next token. The same budget that is fine on a Zen 4
(a 512-token chunk in ~0.5 s) stalls every stream for ~2.5 s on a Zen 1, and machines of our kind differ from
session to session. So, unless the operator fixed the budget, the worker times a short and a long prefill,
fits ``step_ms(n) = fixed_ms + per_token_ms * n`` and gives each step's prefill chunk the largest size that
stays under ``--target-step-ms``, plus one decode token for each of ``max_num_seqs`` running requests: decodes
cost far less per token than prefill, are served first, and must never crowd prefill out entirely (a budget of
only ``max_num_seqs`` would starve every waiting request while the batch is full).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Final

from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine

log = logging.getLogger("kvgate.worker.sizing")

# Defaults for --target-step-ms: a CPU step this long keeps streams readable (a few tokens a second at
# worst) and chunks large enough that the fixed cost of a step (reading every weight once) stays small; a
# GPU step is far cheaper per token, so a shorter target costs little throughput and buys a smooth stream.
DEFAULT_TARGET_STEP_MS: Final = {"cpu": 500.0, "cuda": 100.0}
CEILING: Final = 8192  # beyond this a larger chunk buys nothing but memory for activations
MIN_PREFILL_CHUNK: Final = 32  # on the slowest machine prefill still advances this much per step
_SHORT, _LONG = 32, 256  # probe prompt lengths (tokens)
_SALT: Final = "\0step-sizing"  # never a tenant's salt: nothing of the probes is shared with real requests


@dataclass(frozen=True, slots=True)
class StepSizing:
    max_num_batched_tokens: int
    fixed_ms: float  # cost of a step regardless of its tokens
    per_token_ms: float  # cost of one more prefill token
    target_ms: float


def default_target_ms(device: str) -> float:
    return DEFAULT_TARGET_STEP_MS["cuda" if device.startswith("cuda") else "cpu"]


def _prefill_ms(engine: LLMEngine, n: int, tag: str) -> float:
    """Wall time of one step that prefills ``n`` prompt tokens and samples one token."""
    engine.add_request(f"\0sizing-{tag}", [(i * 7919) % engine.vocab_size for i in range(n)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=_SALT + tag)
    start = time.perf_counter()
    engine.step()
    elapsed = (time.perf_counter() - start) * 1000.0
    while engine.has_unfinished():  # reports the finish (and would run anything left, which nothing is)
        engine.step()
    return elapsed


def measure(engine: LLMEngine, target_ms: float, max_num_seqs: int) -> StepSizing:
    """Time probe prefills (the best of three each, so a hiccup of the machine does not shrink the budget for
    the worker's whole life) and size the budget. The engine's counters are reset afterwards."""
    long_n = max(_SHORT + 1, min(_LONG, engine.max_model_len - 1))
    engine.set_token_budget(max(long_n, engine.scheduler.config.max_num_batched_tokens))  # a probe in one step
    short = min(_prefill_ms(engine, _SHORT, f"s{i}") for i in range(3))
    long = min(_prefill_ms(engine, long_n, f"l{i}") for i in range(3))
    per_token = max((long - short) / (long_n - _SHORT), 1e-6)
    fixed = max(0.0, short - per_token * _SHORT)
    chunk = max(MIN_PREFILL_CHUNK, int((target_ms - fixed) / per_token))
    budget = min(CEILING, max_num_seqs + chunk)
    engine.reset_counters()
    return StepSizing(budget, fixed, per_token, target_ms)


def apply(engine: LLMEngine, budget: int) -> None:
    """Give the engine's steps this token budget."""
    engine.set_token_budget(budget)
