"""``--speculative-config`` (vLLM's shape), validated: torch-free, so the gateway checks ``kvgate serve``'s
flag before it starts workers and the engine (``workers.core.spec_decode``) uses the same type."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
         "acceptance_threshold")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 3  # K: at most this many drafted tokens per request and step
    prompt_lookup_min: int = 1  # shortest suffix n-gram that may match
    prompt_lookup_max: int = 3  # longest suffix n-gram tried first
    disable_by_batch_size: int = 4  # no drafts while more requests than this run (vLLM's name)
    acceptance_threshold: float = 0.3  # a request whose acceptance EMA falls below this stops drafting
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method must be 'ngram' (the only one implemented), got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        t = self.acceptance_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"speculative acceptance_threshold must be a number in [0, 1], got {t!r}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """``--speculative-config`` (vLLM's shape); every problem is a ValueError that names it."""
        try:
            raw: Any = json.loads(text)
        except ValueError:
            raise ValueError(f"--speculative-config is not JSON: {text!r}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; known: {list(_KEYS)}")
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        raw = dict(raw)
        raw.setdefault("prompt_lookup_min", 1)
        if "prompt_lookup_max" not in raw and isinstance(raw["prompt_lookup_min"], int):
            raw["prompt_lookup_max"] = max(raw["prompt_lookup_min"], SpeculativeConfig.prompt_lookup_max)
        return cls(**raw)
