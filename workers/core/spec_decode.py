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

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from common.speculative import SpeculativeConfig

EMA_WEIGHT = 0.5
PROBE_INTERVAL = 8
__all__ = ["SpeculativeConfig", "SpecCounters", "SpecState", "draft", "may_draft", "propose_ngram",
           "update_acceptance"]

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

    def copy(self) -> SpecCounters:
        """An independent copy (its per-position list too)."""
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))


def may_draft(state: SpecState, cfg: SpeculativeConfig, num_running: int) -> bool:
    """The back-off rule (module docstring). Called once per decode scheduling of the request."""
    if num_running > cfg.disable_by_batch_size:
        return False
    if state.acceptance_ema >= cfg.acceptance_threshold:
        return True
    return state.steps_without_draft >= PROBE_INTERVAL


def draft(state: SpecState, cfg: SpeculativeConfig, room: int, num_running: int,
          tokens: Callable[[], Sequence[int]]) -> list[int]:
    """A decoding request's draft: up to ``room`` tokens proposed from its ``tokens()`` (prompt + output, read
    only when a draft is tried), or [] where the back-off rule says no (a step without a draft counts
    towards the next probe)."""
    if room < 1 or not may_draft(state, cfg, num_running):
        update_acceptance(state, 0, 0)
        return []
    proposed = propose_ngram(tokens(), cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                             min(cfg.num_speculative_tokens, room))
    if not proposed:
        update_acceptance(state, 0, 0)
    return proposed


def update_acceptance(state: SpecState, drafted: int, accepted: int) -> None:
    if drafted:
        state.acceptance_ema = EMA_WEIGHT * (accepted / drafted) + (1.0 - EMA_WEIGHT) * state.acceptance_ema
        state.steps_without_draft = 0
    else:
        state.steps_without_draft += 1
