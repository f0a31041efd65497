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
from gateway.pipeline.prompt_logprobs import echo_logprobs, join, vllm_prompt_logprobs
from gateway.pipeline.tool_stream import ToolCallParser
from ipc.messages import PromptLogprob
from ipc.messages import TokenLogprobs
from tenancy.tiers import openai_service_tier

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
                 tok: GatewayTokenizer, ran_as: str | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.req = req
        self.tok = tok
        # OpenAI's: a request that set service_tier is told the one it ran in (``ran_as``: the tier it was submitted
        # as); one that did not is not
        self.service_tier = None if req.service_tier is None or ran_as is None else openai_service_tier(ran_as)
        self._text_offsets: dict[int, int] = {}  # completions logprobs, per choice: where its next token starts
        self._parsers: dict[int, ToolCallParser] = {}  # chat with tools, per streamed choice
        self._prompt_done: set[int] = set()  # streamed choices whose echo / prompt_logprobs went out

    @property
    def _with_tools(self) -> bool:
        return self.req.kind == "chat" and self.req.tools is not None

    def _new_parser(self) -> ToolCallParser:
        return ToolCallParser(self.req.tools.syntax) if self.req.tools is not None else ToolCallParser()

    def _finish(self, finish: str | None, parser: ToolCallParser) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a call forced by name ends with "stop"
        tools = self.req.tools
        if finish == "stop" and parser.calls and tools is not None and tools.mode != "named":
            return "tool_calls"
        return finish

    def _envelope(self, obj: str) -> dict[str, Any]:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}
        if self.service_tier is not None:
            body["service_tier"] = self.service_tier
        return body

    def usage(self, choices: Choices) -> dict[str, Any]:
        return usage(self.req.prompt_tokens, choices.completion_tokens, choices.cached_tokens)

    # ---- streaming ------------------------------------------------------------------------------

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        if self.req.kind != "chat" or self._with_tools:
            return None  # with tools the role goes out with the first content or call, once it is known which
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def _prompt_part(self, index: int, lps: list[PromptLogprob] | None) -> tuple[str, dict[str, Any] | None,
                                                                                 list[Any] | None]:
        """What leads a choice: (echoed text, its logprobs, vLLM's prompt_logprobs); once per streamed choice.
        ``lps``: all of the prompt's (the assembler gathers the worker's chunks until the first token)."""
        if not self._prompt_due(index):
            return "", None, None
        self._prompt_done.add(index)
        req, lps = self.req, lps or []
        prompt = req.prompts()[index // req.n]  # choices go prompt by prompt, n each
        echo_lp = None
        if prompt.echo is not None and req.logprobs:
            echo_lp = echo_logprobs(self.tok, prompt.ids, lps, req.top_logprobs)
            self._text_offsets[index] = len(prompt.echo)
        plp = None if req.prompt_logprobs is None else vllm_prompt_logprobs(self.tok, prompt.ids, lps,
                                                                            req.prompt_logprobs)
        return prompt.echo or "", echo_lp, plp

    def _prompt_due(self, index: int) -> bool:
        return index not in self._prompt_done and (self.req.echo is not None or self.req.prompt_logprobs is not None)

    def delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks for ``d``: one, or none when nothing visible happened; with tools, a call's first chunk (its
        id and name) goes out on its own, as OpenAI's does, before its argument fragments."""
        if self._with_tools and not self._prompt_due(d.index):
            return [self._chunk(c) for c in self._tool_deltas(d, self._token_logprobs(d))]
        chunk = self.delta_chunk(d)
        return [] if chunk is None else [chunk]

    def _token_logprobs(self, d: Delta) -> dict[str, Any] | None:
        return self._logprobs(d.index, d.token_ids, d.logprobs) if self.req.logprobs and d.logprobs else None

    def delta_chunk(self, d: Delta) -> dict[str, Any] | None:
        echo, echo_lp, plp = self._prompt_part(d.index, d.prompt_logprobs)
        if not (d.text or echo or plp) and d.finish_reason is None and not (self.req.logprobs and d.logprobs):
            return None  # nothing visible happened (a held-back or partial character)
        lp = None
        if self.req.logprobs and d.logprobs:
            lp = self._logprobs(d.index, d.token_ids, d.logprobs)
        if echo_lp is not None:
            lp = join(echo_lp, lp)
        if plp is not None and self.req.kind == "chat":  # vLLM: chat has it beside the choices
            chunk = self.delta_chunk(Delta(d.text, d.token_ids, d.logprobs, d.finish_reason, d.index))
            chunk = chunk or self._chunk({"index": d.index, "delta": {}, "logprobs": None, "finish_reason": None})
            return {**chunk, "prompt_logprobs": plp}
        if self._with_tools:
            choices = self._tool_deltas(d, lp)
            if not choices:
                return None
            merged = {**choices[-1], "delta": {k: v for c in choices for k, v in c["delta"].items()
                                                if k != "tool_calls"}}
            calls = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
            if calls:
                merged["delta"]["tool_calls"] = calls
            choice = merged
        elif self.req.kind == "chat":
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                      "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index, "text": echo + d.text, "logprobs": lp, "finish_reason": d.finish_reason}
            if plp is not None:
                choice["prompt_logprobs"] = plp
        return self._chunk(choice)

    def _tool_deltas(self, d: Delta, lp: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The choice deltas for ``d`` with tools: a call's first entry (id, name) alone in its chunk, its
        argument fragments after it; the finish reason and logprobs on the last one."""
        parser = self._parsers.setdefault(d.index, self._new_parser())
        text, calls = parser.feed(d.text, final=d.finish_reason is not None)
        deltas: list[dict[str, Any]] = []
        if calls:
            for entry in calls:  # a new call's entry opens a chunk; fragments join the chunk before them
                if "id" in entry or not deltas or "id" in deltas[-1]["tool_calls"][-1]:
                    deltas.append({"tool_calls": [entry]})
                else:
                    deltas[-1]["tool_calls"].append(entry)
        elif text or (d.finish_reason is not None and not parser.sent_role):
            deltas.append({"content": text})
        if deltas and not parser.sent_role:
            deltas[0] = {"role": "assistant", **({"content": None} if calls else {}), **deltas[0]}
            parser.sent_role = True
        if not deltas and (d.finish_reason is not None or lp is not None):
            deltas.append({})
        out: list[dict[str, Any]] = [{"index": d.index, "delta": delta, "logprobs": None, "finish_reason": None}
                                     for delta in deltas]
        if out:
            out[-1]["logprobs"], out[-1]["finish_reason"] = lp, self._finish(d.finish_reason, parser)
        return out

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
        returned = choices.returned()
        body["choices"] = [self._final_choice(i, asm) for i, asm in enumerate(returned)]
        if self.req.kind == "chat" and self.req.prompt_logprobs is not None:  # vLLM: beside the choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, self.req.prompt_ids,
                                                           returned[0].prompt_logprobs or [], self.req.prompt_logprobs)
        body["usage"] = self.usage(choices)
        return body

    def _final_choice(self, index: int, asm: OutputAssembler) -> dict[str, Any]:
        # the prompt's part first: with echo the completion's text offsets start after it
        chat = self.req.kind == "chat"
        echo, echo_lp, plp = ("", None, None) if chat else self._prompt_part(index, asm.prompt_logprobs)
        lp = self._logprobs(index, asm.token_ids, asm.logprobs) if self.req.logprobs else None
        if self._with_tools:
            parser = self._new_parser()
            parser.feed(asm.text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": parser.content if not parser.calls else None}
            if parser.calls:
                message["tool_calls"] = parser.tool_calls()
            return {"index": index, "message": message, "logprobs": lp,
                    "finish_reason": self._finish(asm.finish_reason, parser)}
        if self.req.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": asm.text}, "logprobs": lp,
                    "finish_reason": asm.finish_reason}
        choice = {"index": index, "text": echo + asm.text,
                  "logprobs": join(echo_lp, lp) if echo_lp is not None else lp, "finish_reason": asm.finish_reason}
        if plp is not None:
            choice["prompt_logprobs"] = plp
        return choice
