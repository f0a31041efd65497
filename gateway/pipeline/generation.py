"""From worker outputs to client text: incremental detokenization, stop strings, logprobs, usage counts.

Stop strings are the gateway's job (the worker only knows token ids). While a request runs, the last
``len(longest stop) - 1`` characters are held back, so text that turns out to start a stop string is never
sent; once a stop string appears, the text is cut before it, the request finishes with "stop", and the
caller aborts it on the worker.

One assembler follows one sequence: a request with ``n`` or ``best_of`` above 1 has one per sequence, each
knowing its choice ``index`` and the cumulative logprob of what it kept (how ``best_of`` ranks them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.pipeline.tokenizer import GatewayTokenizer
from ipc.messages import EngineTimings, PromptLogprob, RequestOutputMsg, TokenLogprobs
from common.detokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token in token_ids, when logprobs were asked for
    finish_reason: str | None
    index: int = 0  # the choice it belongs to
    prompt_logprobs: list[PromptLogprob] | None = None  # all of them, on the first token's delta, when asked for

    @property
    def empty(self) -> bool:
        """Nothing for the client: a prefill chunk's prompt logprobs, held until the prompt is complete."""
        return not self.token_ids and self.finish_reason is None and self.prompt_logprobs is None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class OutputAssembler:
    """Accumulates one sequence's outputs; ``add`` returns what may be sent to the client now."""

    def __init__(self, tok: GatewayTokenizer, stop: tuple[str, ...], want_logprobs: bool, index: int = 0) -> None:
        self.index = index
        self._detok = IncrementalDetokenizer(tok)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._want_logprobs = want_logprobs
        self.text = ""  # decoded text so far (cut at a stop string once one is found)
        self._emitted = 0  # characters of self.text already handed out
        self._searched = 0  # self.text[:_searched] is known to contain no stop string
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        # Sum of the kept tokens' logprobs, when the worker sent them (it does for best_of even when the client
        # did not ask): the sequence's log-likelihood, what best_of ranks by.
        self.cumulative_logprob = 0.0
        self.num_cached_tokens = 0
        self.first_token_at: float | None = None  # time.monotonic() when the first token arrived
        self.finish_reason: str | None = None
        self.hit_stop_string = False  # the worker still runs the request: the caller must abort it
        self.engine_timings: EngineTimings | None = None  # from the worker's last output, when it came
        self.engine_timings_at: float | None = None  # time.monotonic() when it came
        # The worker sends them chunk by chunk as its prefill computes them (a step's output carries only its
        # chunk's, so no frame grows with the prompt); gathered here, complete once the first token comes
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self._prompt_lps: list[PromptLogprob] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_reasons(self) -> list[str | None]:  # as Choices has them (what the trace reads)
        return [self.finish_reason]

    def add(self, out: RequestOutputMsg) -> Delta:
        if self.finished:
            return Delta("", [], None, None, self.index)
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if out.timings is not None:
            self.engine_timings, self.engine_timings_at = out.timings, time.monotonic()
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs:
            self._prompt_lps.extend(out.prompt_logprobs)
        if not out.new_token_ids and out.finish_reason is None:
            return Delta("", [], None, None, self.index)  # a prefill chunk: the prompt is not complete yet
        prompt_lps = None
        if self.prompt_logprobs is None and self._prompt_lps:
            self.prompt_logprobs = prompt_lps = self._prompt_lps
        ids, hit = self._take_until_stop(list(out.new_token_ids))
        finish = out.finish_reason
        if hit:
            finish = "stop"
            self.hit_stop_string = out.finish_reason is None
        self.token_ids.extend(ids)
        kept = list(out.logprobs)[:len(ids)] if out.logprobs else []
        self.cumulative_logprob += sum(lp for lp, _ in kept)
        new_logprobs = kept if self._want_logprobs and kept else None
        if new_logprobs:
            self.logprobs.extend(new_logprobs)
        end = len(self.text) if finish is not None else max(self._emitted, len(self.text) - self._hold)
        text, self._emitted = self.text[self._emitted:end], end
        self.finish_reason = finish
        return Delta(text, ids, new_logprobs, finish, self.index, prompt_lps)

    def _take_until_stop(self, ids: list[int]) -> tuple[list[int], bool]:
        """Decode ``ids``; with stop strings, token by token, so that of an output of several tokens (a
        speculative-decoding run) those after the one completing a stop string are neither counted nor sent."""
        if not self._stop:
            self.text += self._detok.add(ids)
            return ids, False
        for j, t in enumerate(ids):
            self.text += self._detok.add([t])
            if self._cut_at_stop():
                return ids[:j + 1], True
        return ids, False

    def _cut_at_stop(self) -> bool:
        start = max(0, self._searched - self._hold)  # a stop string may straddle the old end
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        self.text = self.text[:min(hits)]
        self._emitted = min(self._emitted, len(self.text))  # never true in practice: held-back text
        return True
