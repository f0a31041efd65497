"""Per-request sampling parameters: a typed wire message (``Generate.sampling``) and the engine's own type.

Validated on construction (bad values raise ValueError), so each trust boundary checks them exactly once: the
gateway when it parses the user's JSON into one, the worker when ``ipc.codec`` decodes a Generate frame (a
frame whose parameters fail is a ProtocolError). The engine (``workers.core``) uses this class as is."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias: bounded, as every field of a frame is


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to sample and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int | None = 16  # None: until the model's context is full
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per sampled token; 0 = only the sampled token
    structured: str | None = None  # a grammar spec as JSON (workers/structured.py); None: unconstrained
    # vLLM's prompt_logprobs: for every prompt token after the first, its logprob given the tokens before it and
    # this many alternatives; such a request computes its whole prompt (no prefix-cache hit), once
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before sampling; sorted by id
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # frozen: normalise a list of stop ids into a tuple so params stay hashable and immutable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in self.logit_bias)))
        self._check_types()
        self._check_ranges()

    def _check_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an integer or None, got {v!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias token ids must be non-negative integers, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r}")
        if self.structured is not None and not isinstance(self.structured, str):
            raise ValueError(f"structured must be a JSON string or None, got {type(self.structured).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    def _check_ranges(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether its logits change before sampling (penalties, logit_bias): the sampler's per-row work."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))
