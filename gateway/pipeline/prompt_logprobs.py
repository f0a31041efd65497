"""The prompt's own logprobs in a response: vLLM's ``prompt_logprobs`` field, and ``echo`` on completions.

The worker sends one ``(logprob, rank, top-N)`` per prompt token after the first (``ipc.messages.PromptLogprob``;
the first token has no context, so it has none: ``null`` in both shapes), chunk by chunk as its prefill computes
them; ``OutputAssembler`` gathers them, and they are complete when the first generated token arrives.

- ``prompt_logprobs`` (vLLM's shape): a list as long as the prompt, ``null`` first, then per token a map from
  token id (a string, as JSON keys are) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt's token
  and the top-N alternatives.
- ``echo`` with ``logprobs`` (OpenAI's legacy completions): the prompt's tokens lead ``tokens``,
  ``token_logprobs`` (``null`` first), ``top_logprobs`` and ``text_offset``, the completion's follow.
"""

from __future__ import annotations

from typing import Any

from gateway.pipeline.tokenizer import GatewayTokenizer
from ipc.messages import PromptLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def vllm_prompt_logprobs(tok: GatewayTokenizer, prompt_ids: list[int], lps: list[PromptLogprob],
                         top_n: int) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for token_id, (lp, rank, top) in zip(prompt_ids[1:], lps):
        entry = {str(tid): {"logprob": _lp(tlp), "rank": r + 1, "decoded_token": tok.token_text(tid)}
                 for r, (tid, tlp) in enumerate(top[:top_n])}
        entry[str(token_id)] = {"logprob": _lp(lp), "rank": rank, "decoded_token": tok.token_text(token_id)}
        out.append(entry)
    return out


def echo_logprobs(tok: GatewayTokenizer, prompt_ids: list[int], lps: list[PromptLogprob],
                  top_n: int) -> dict[str, Any]:
    """The prompt's part of a completion's ``logprobs`` (offsets from 0)."""
    tokens = [tok.token_text(t) for t in prompt_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    token_lps: list[float | None] = [None] + [_lp(lp) for lp, _, _ in lps]
    tops: list[dict[str, float] | None] = [None]
    tops.extend({tok.token_text(tid): _lp(tlp) for tid, tlp in top[:top_n]} if top_n else None for _, _, top in lps)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    if then is None:
        return first
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
