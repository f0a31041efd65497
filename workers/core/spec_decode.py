"""N-gram (prompt-lookup) speculative decoding, the pure half: the config, the proposer, the back-off rule and
the counters. The torch half (verifying drafts against the model's distribution) is ``workers.spec_verify``.

A decoding request whose own prompt + output ends in an n-gram that occurred earlier in it gets the tokens that
followed that earlier occurrence as a draft; the scheduler then schedules it as 1 + K query tokens (its last
token and the draft), one forward pass scores all of them, and the runner keeps the longest prefix the model
agrees with plus one token of the model's own. The block manager trims the blocks of rejected tokens.

Back-off (never a slowdown on speculation's account), decided per request at each scheduling:
  1. batch: no drafts at all while more than ``disable_by_batch_size`` requests run (a large batch is no longer
     bound by reading the weights, so the extra query tokens cost real compute);
  2. acceptance: each request keeps an EMA of accepted / drafted tokens (weight ``EMA_WEIGHT`` on the newest
     step, starting at 1); below ``acceptance_threshold`` it stops drafting, and probes again (one draft)
     after ``PROBE_INTERVAL`` decode steps without one, so a request whose text turns repetitive recovers.
Requests with a structured-output grammar never draft (their matcher would have to advance through the draft
and roll back). Everything else (greedy or sampled, penalties, logit bias, min_tokens, logprobs) does.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

EMA_WEIGHT = 0.5
PROBE_INTERVAL = 8
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


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram of
    ``tokens`` (``max_n`` down to ``min_n``); [] when no suffix of that length occurred before."""
    n_tok = len(tokens)
    if k < 1 or n_tok < min_n + 1:
        return []
    buf = array("i", tokens).tobytes()  # 4 bytes a token: bytes.rfind searches in C
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        pattern = buf[(n_tok - n) * 4:]
        end = (n_tok - 1) * 4  # the match must end before the last token, so at least one token follows it
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # aligned to a token boundary (an unaligned hit straddles two tokens)
                start = at // 4 + n
                return list(tokens[start:start + k])
            end = at + len(pattern) - 1
    return []


@dataclass
class SpecState:
    """A request's speculation state (on the Request; the scheduler reads and updates it)."""

    draft: list[int] = field(default_factory=list)  # drafted tokens scheduled this step
    acceptance_ema: float = 1.0
    steps_without_draft: int = 0


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode counters: drafts (requests x steps with a draft), drafted tokens,
    accepted tokens, accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = []


def may_draft(state: SpecState, cfg: SpeculativeConfig, num_running: int) -> bool:
    """The back-off rule (module docstring). Called once per decode scheduling of the request."""
    if num_running > cfg.disable_by_batch_size:
        return False
    if state.acceptance_ema >= cfg.acceptance_threshold:
        return True
    return state.steps_without_draft >= PROBE_INTERVAL


def update_acceptance(state: SpecState, drafted: int, accepted: int) -> None:
    if drafted:
        state.acceptance_ema = EMA_WEIGHT * (accepted / drafted) + (1.0 - EMA_WEIGHT) * state.acceptance_ema
        state.steps_without_draft = 0
    else:
        state.steps_without_draft += 1
