"""OpenAI response bodies: chat.completion(.chunk), text_completion, usage and logprobs, as plain dicts.

With several choices every chunk carries one choice's delta under its ``index`` (they interleave as tokens
arrive) and the same ``id``, ``created`` and ``model``; usage counts the prompt once and sums the completions.
"""

from __future__ import annotations

import math
from typing import Any

from gateway.pipeline.choices import Choices
from gateway.pipeline.generation import Delta, OutputAssembler
from gateway.pipeline.protocol import GenerationRequest
from gateway.pipeline.tokenizer import GatewayTokenizer
from ipc.messages import TokenLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(tok: GatewayTokenizer, ids: list[int], lps: list[TokenLogprobs], top_n: int) -> dict[str, Any]:
    content = []
    for token_id, (lp, top) in zip(ids, lps):
        text = tok.token_text(token_id)
        content.append({
            "token": text, "logprob": _lp(lp), "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := tok.token_text(tid)), "logprob": _lp(tlp), "bytes": list(t.encode())}
                             for tid, tlp in top[:top_n]],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(tok: GatewayTokenizer, ids: list[int], lps: list[TokenLogprobs], top_n: int,
                        offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, (lp, top) in zip(ids, lps):
        text = tok.token_text(token_id)
        tokens.append(text)
        token_lps.append(_lp(lp))
        tops.append({tok.token_text(tid): _lp(tlp) for tid, tlp in top[:top_n]} if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class ResponseBuilder:
    """Builds the bodies of one request's response, stream chunks or the final object."""

    def __init__(self, request_id: str, model: str, created: int, req: GenerationRequest,
                 tok: GatewayTokenizer) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.req = req
        self.tok = tok
        self._text_offsets: dict[int, int] = {}  # completions logprobs, per choice: where its next token starts

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, choices: Choices) -> dict[str, Any]:
        return usage(len(self.req.prompt_ids), choices.completion_tokens, choices.cached_tokens)

    # ---- streaming ------------------------------------------------------------------------------

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        if self.req.kind != "chat":
            return None
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, d: Delta) -> dict[str, Any] | None:
        if not d.text and d.finish_reason is None and not (self.req.logprobs and d.logprobs):
            return None  # nothing visible happened (a held-back or partial character)
        lp = None
        if self.req.logprobs and d.logprobs:
            lp = self._logprobs(d.index, d.token_ids, d.logprobs)
        if self.req.kind == "chat":
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                      "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return self._chunk(choice)

    def usage_chunk(self, choices: Choices) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.req.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(choices)
        return body

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.req.kind == "chat" else "text_completion")
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None  # as OpenAI: present (null) on every chunk when include_usage is set
        return body

    def _logprobs(self, index: int, ids: list[int], lps: list[TokenLogprobs]) -> dict[str, Any]:
        if self.req.kind == "chat":
            return chat_logprobs(self.tok, ids, lps, self.req.top_logprobs)
        offset = self._text_offsets.get(index, 0)
        out = completion_logprobs(self.tok, ids, lps, self.req.top_logprobs, offset)
        self._text_offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    # ---- whole response -----------------------------------------------------------------------

    def final(self, choices: Choices) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.req.kind == "chat" else "text_completion")
        # Ranked by best_of when it generated more than n: the choice index is the rank, not the generation order.
        body["choices"] = [self._final_choice(i, asm) for i, asm in enumerate(choices.returned())]
        body["usage"] = self.usage(choices)
        return body

    def _final_choice(self, index: int, asm: OutputAssembler) -> dict[str, Any]:
        lp = self._logprobs(index, asm.token_ids, asm.logprobs) if self.req.logprobs else None
        if self.req.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": asm.text}, "logprobs": lp,
                    "finish_reason": asm.finish_reason}
        return {"index": index, "text": asm.text, "logprobs": lp, "finish_reason": asm.finish_reason}
