"""The Responses API's objects as plain dicts, in OpenAI's shape (the official SDK parses them): the response, its
one output message, usage, and the typed stream events with their ``sequence_number``.

A stream is, in order: ``response.created`` and ``response.in_progress`` (the response, ``in_progress``, no output),
``response.output_item.added`` (the message, empty), ``response.content_part.added`` (an empty ``output_text``), one
``response.output_text.delta`` per piece of text, then ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it).
A failure after the stream started is an ``error`` event (the gateway's code) and ``response.failed``. Each event is
sent as OpenAI does: an ``event:`` line naming its type, then its ``data:``.

With tools the output is either that message or ``function_call`` items, one per call, decided by the answer's
first characters (``gateway.pipeline.tool_stream``): the message's opening events wait for that, and a call streams
as ``response.output_item.added`` (name, empty arguments), ``response.function_call_arguments.delta`` fragments,
``...arguments.done`` and ``response.output_item.done``. The stream's parser also builds the final object, so the
streamed items and the final ones have the same ids.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.base.errors import APIError
from gateway.pipeline.choices import Choices
from gateway.pipeline.protocol import GenerationRequest
from gateway.pipeline.tool_stream import ToolCallParser
from gateway.pipeline.tools import SYNTAX
from gateway.responses.items import new_id
from gateway.responses.request import ResponsesRequest
from tenancy.tiers import DEFAULT_TIER, openai_service_tier

# ResponseError.code takes OpenAI's values only: a prompt the model cannot take is "invalid_prompt", the rest
# (worker gone, timeout, a client too slow) "server_error"; the preceding ``error`` event carries the exact code.
_PROMPT_CODES = frozenset({"invalid_request", "context_length_exceeded"})


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseDraft:
    """One response's ids and settings, and every object and event built from them."""

    def __init__(self, response_id: str, model: str, created_at: int, req: ResponsesRequest,
                 gen: GenerationRequest, ran_as: str = DEFAULT_TIER) -> None:
        self.id = response_id
        self.service_tier = openai_service_tier(ran_as)  # the tier it ran in, OpenAI's name (asked for or not)
        self.message_id = new_id("msg")
        self.model = model
        self.created_at = created_at
        self.req = req
        self.gen = gen
        self._sequence = 0
        self.parser: ToolCallParser | None = None  # with tools: the answer's text or calls, as it streams
        self._call_ids: list[str] = []  # the function_call items' ids, one per call the parser found
        self._message_open = False

    def envelope(self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None,
                 **extra: Any) -> dict[str, Any]:
        r, sampling = self.req, self.gen.sampling
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": None, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": r.tools.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": self.service_tier, "store": r.store,
            "temperature": sampling.temperature, "text": {"format": r.text_format, "verbosity": "medium"},
            "tool_choice": r.tools.tool_choice, "tools": r.tools.tools, "top_logprobs": 0, "top_p": sampling.top_p,
            "truncation": r.truncation, "usage": use, "user": r.user, "metadata": r.metadata,
        }
        body.update(extra)
        return body

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message; ``text`` None while it has no content part yet (the stream's first sight of it)."""
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if text is None else [text_part(text)]}

    def _new_parser(self) -> ToolCallParser:
        return ToolCallParser(self.gen.tools.syntax if self.gen.tools is not None else SYNTAX["generic"])

    def call_item(self, i: int, status: str) -> dict[str, Any]:
        if self.parser is None:
            raise RuntimeError("a function_call item before the answer was parsed")
        call = self.parser.tool_calls()[i]
        return {"id": self._call_ids[i], "type": "function_call", "status": status, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"]}

    def _output(self, text: str, status: str) -> list[dict[str, Any]]:
        if self.gen.tools is None:
            return [self.message(text, status)]
        if self.parser is None:  # not streamed: the whole answer at once
            self.parser = self._new_parser()
            self.parser.feed(text, final=True)
        self._call_ids += [new_id("fc") for _ in range(len(self.parser.tool_calls()) - len(self._call_ids))]
        if not self.parser.calls:
            return [self.message(self.parser.content, status)]
        return [self.call_item(i, status) for i in range(len(self._call_ids))]

    def final(self, choices: Choices) -> dict[str, Any]:
        """The finished response: ``incomplete`` when the output was cut at its token limit."""
        out = choices.returned()[0]
        use = usage(len(self.gen.prompt_ids), choices.completion_tokens, choices.cached_tokens)
        if out.finish_reason == "length":
            return self.envelope("incomplete", self._output(out.text, "incomplete"), use,
                                 incomplete_details={"reason": "max_output_tokens"})
        return self.envelope("completed", self._output(out.text, "completed"), use, completed_at=int(time.time()))

    # ---- stream events --------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        started = self.envelope("in_progress", [], None)
        events = [self.event("response.created", response=started),
                  self.event("response.in_progress", response=started)]
        if self.gen.tools is None:
            events += self._open_message()
        else:
            self.parser = self._new_parser()  # the message opens once the answer is known to be text
        return events

    def _open_message(self) -> list[str]:
        self._message_open = True
        return [self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", **self._at(), part=text_part(""))]

    def deltas(self, text: str, final: bool) -> list[str]:
        """The events for the next piece of the answer's text."""
        if self.parser is None:
            return [self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[])] if text else []
        content, calls = self.parser.feed(text, final)
        events = self._open_message() if content and not self._message_open else []
        if content:
            events.append(self.event("response.output_text.delta", **self._at(), delta=content, logprobs=[]))
        for delta in calls:
            events += self._call_events(delta)
        return events

    def _call_events(self, delta: dict[str, Any]) -> list[str]:
        i = delta["index"]
        events = []
        if "id" in delta:  # a new call: the one before it is complete
            if i > 0:
                events += self._close_call(i - 1, "completed")
            self._call_ids.append(new_id("fc"))
            item = {**self.call_item(i, "in_progress"), "arguments": ""}
            events.append(self.event("response.output_item.added", output_index=i, item=item))
        if delta["function"]["arguments"]:
            events.append(self.event("response.function_call_arguments.delta", item_id=self._call_ids[i],
                                     output_index=i, delta=delta["function"]["arguments"]))
        return events

    def _close_call(self, i: int, status: str) -> list[str]:
        item = self.call_item(i, status)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=i, item=item)]

    def closing(self, final: dict[str, Any]) -> list[str]:
        ending = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        item = final["output"][0]
        if item["type"] == "function_call":
            last = len(final["output"]) - 1
            return [*self._close_call(last, final["output"][last]["status"]), self.event(ending, response=final)]
        events = [] if self._message_open else self._open_message()  # an empty answer: opened at its end
        part = item["content"][0]
        return [*events, self.event("response.output_text.done", **self._at(), text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **self._at(), part=part),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(ending, response=final)]

    def failed(self, err: APIError) -> list[str]:
        code = "invalid_prompt" if err.code in _PROMPT_CODES else "server_error"
        response = self.envelope("failed", [], None, error={"code": code, "message": err.message})
        return [self.event("error", code=err.code, message=err.message, param=err.param),
                self.event("response.failed", response=response)]
