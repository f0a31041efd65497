"""Driving one Responses request to its end as a typed event stream (plainly: ``streaming.run_to_end``)
(``ResponsesStream``).

Both follow the chat pipeline's rules and reuse its pieces (``gateway.pipeline.streaming``): ``follow_all`` over
the request's sequences under the request deadline, the ledger row durable before the end is told (``Account``),
``release_all`` and ``Account.end`` in every ``finally``. The stream is the chat stream's design too: a producer task
in the app-wide nursery feeds a small bounded channel that the response body (``SSEBody``) drains; a client that goes
away closes the body, which cancels the producer, whose ``finally`` releases the sequences (the pool aborts them on
their workers). What differs is the events (``gateway.responses.objects``) and the store: a stored response is
written after the ledger row and before ``response.completed``, so whoever sees the end can continue from it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import trio

from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed
from gateway.pipeline.choices import Child, Choices
from gateway.pipeline.generation import Delta
from gateway.pipeline.streaming import Account, ConsumerGone, EventProducer, failure_to_api_error, follow_all
from gateway.responses.objects import ResponseDraft

log = logging.getLogger("kvgate.gateway.responses")

Save = Callable[[dict[str, Any]], Awaitable[None]]  # stores the final response object; raises APIError if it cannot


def _deadline(timeout: float | None) -> AbstractContextManager[Any]:
    return trio.fail_after(timeout) if timeout is not None else nullcontext()


class ResponsesStream(EventProducer):
    """One Responses stream: its typed events; the stored response written before ``response.completed``."""

    def __init__(self, choices: Choices, draft: ResponseDraft, timeout: float | None, ping_interval: float,
                 stall_timeout: float, account: Account, save: Save | None) -> None:
        super().__init__(choices, timeout, ping_interval, stall_timeout, account)
        self.draft, self.save = draft, save

    async def _emit(self, _: Child, d: Delta) -> None:
        for event in self.draft.deltas(d.text, final=d.finish_reason is not None):
            await self._put(event)

    async def _stream(self) -> None:
        try:
            for event in self.draft.opening():
                await self._put(event)
            with _deadline(self.timeout):
                await follow_all(self.choices, self._emit, self._ping, self.ping_interval)
            await self.account.finish(self.choices)  # durable in the ledger before the client sees the end
            final = self.draft.final(self.choices)
            if self.save is not None:
                await self.save(final)
            for event in self.draft.closing(final):
                await self._put(event)
        except (trio.BrokenResourceError, ConsumerGone):
            return  # the client is gone: nothing to tell it
        except trio.TooSlowError:
            self.status = "timeout"
            await self._fail(APIError(504, "the request timed out", code="timeout"))
        except RequestFailed as e:
            self.status = e.code
            await self._fail(failure_to_api_error(e))
        except APIError as e:  # the store refused the finished response (its ledger row is already written)
            await self._fail(e)

    async def _fail(self, err: APIError) -> None:
        # After the stream started the status is already 200: an error event, then response.failed.
        log.info("response stream %s failed: %s (%s)", self.choices.request_id, err.code, err.status)
        try:
            with trio.move_on_after(1.0):
                for event in self.draft.failed(err):
                    await self._send.send(event)
        except trio.BrokenResourceError:
            pass
