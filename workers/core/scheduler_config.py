"""The scheduler's configuration: the step's token budget and sequence slots, the policy, speculative decoding,
LoRA adapters a step and the background prefill cap; frozen and checked when made (``workers.core.scheduler``
plans steps under it)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.core import priority
from workers.core.spec_decode import SpeculativeConfig


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
