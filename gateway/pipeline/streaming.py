"""Driving one request to its end, as a plain JSON response or as a Server-Sent Events stream.

Streams follow the Trio rule of never yielding inside a nursery or cancel scope: a producer task in the
app-level nursery waits on the worker (under the request deadline, sending ``: ping`` comments while idle)
and puts finished SSE events into a small bounded channel; the response body (``SSEBody``) only drains that
channel. When the client goes away, Quart closes the body, which cancels the producer, whose ``finally``
releases the request so the pool aborts it on the worker.

A request of several sequences (``n``, ``best_of``; ``gateway.pipeline.choices``) follows them all at once, one
task per sequence in one nursery: chunks interleave as tokens arrive, each sequence is released (its KV freed) as
soon as it ends, and the first failure, a disconnect or the deadline cancels the others and releases them all.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from typing import Any, Protocol

import trio

from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed, RequestHandle
from gateway.pipeline.choices import Child, Choices
from gateway.pipeline.generation import Delta, OutputAssembler
from gateway.pipeline.responses import ResponseBuilder

log = logging.getLogger("kvgate.gateway.streaming")

SSE_BUFFER = 16  # events between producer and client; a slow client applies backpressure past it
DONE = "data: [DONE]\n\n"
PING = ": ping\n\n"


def failure_to_api_error(e: RequestFailed) -> APIError:
    if e.code in ("invalid_request", "context_length_exceeded"):
        return APIError(400, e.message, code=e.code)
    if e.code == "model_not_found":  # a worker that cannot find the request's LoRA adapter (workers/engine.py)
        return APIError(404, e.message, code=e.code, param="model")
    if e.code == "client_too_slow":
        return APIError(408, e.message, code=e.code)
    if e.code == "timeout":
        return APIError(504, e.message, code="timeout")
    if e.code in ("worker_died", "draining", "drain_timeout", "gateway_shutdown", "grammar_busy"):
        return APIError(503, e.message, code=e.code, retry_after=1.0)
    return APIError(500, e.message, code=e.code)


def sse_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def follow(handle: RequestHandle, asm: OutputAssembler, emit: Callable[[Delta], Awaitable[None]],
                 ping: Callable[[], Awaitable[None]] | None = None, ping_interval: float = 10.0) -> None:
    """Feed the worker's outputs through ``asm`` until the request finishes; raises RequestFailed."""
    while not asm.finished:
        if ping is None:
            outs = await handle.next_outputs()
        else:
            outs = []
            with trio.move_on_after(ping_interval):
                outs = await handle.next_outputs()
            if not outs:
                await ping()
                continue
        for out in outs:
            if out.error is not None:  # it could never run there: the worker says why and which error it is
                raise RequestFailed(out.error_code or "context_length_exceeded", out.error)
            if out.finish_reason == "abort":  # the worker gave up on it (its deadline passed)
                raise RequestFailed("timeout", "the request timed out")
            delta = asm.add(out)
            if not delta.empty:  # a prefill chunk's prompt logprobs stay in asm until the first token
                await emit(delta)
            if asm.finished:
                break


async def follow_all(choices: Choices, emit: Callable[[Child, Delta], Awaitable[None]],
                     ping: Callable[[], Awaitable[None]] | None = None, ping_interval: float = 10.0) -> None:
    """``follow`` every sequence concurrently. A sequence that ends is released at once (a stop string's abort
    must not wait for its siblings); the first exception of any of them cancels the rest and is raised."""
    failures: list[Exception] = []

    async def one(child: Child, cancel: trio.CancelScope) -> None:
        async def emit_child(d: Delta) -> None:
            if d.finish_reason is not None:
                choices.release(child)
            await emit(child, d)

        try:
            await follow(child.handle, child.asm, emit_child, ping, ping_interval)
        except Exception as e:  # noqa: BLE001 - handed to the caller below, whatever it is
            failures.append(e)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for child in choices.children:
            nursery.start_soon(one, child, nursery.cancel_scope)
    if failures:
        raise failures[0]


def _deadline(timeout: float | None) -> Any:
    return trio.fail_after(timeout) if timeout is not None else nullcontext()


async def run_to_end(choices: Choices, timeout: float | None, account: Account) -> None:
    """Every sequence to its end and the ledger row written (durable before any response leaves), or the failure
    as an ``APIError``; run in the route handler itself (a disconnect cancels it). Chat, completions and the
    Responses API build their plain answers from ``choices`` after it."""
    async def ignore(_: Child, __: Delta) -> None:
        return

    status = "cancelled"  # what the ledger says unless the request gets further
    try:
        with _deadline(timeout):
            await follow_all(choices, ignore)
        await account.finish(choices)
    except trio.TooSlowError:
        status = "timeout"
        raise APIError(504, "the request timed out", code="timeout") from None
    except RequestFailed as e:
        status = e.code
        raise failure_to_api_error(e) from None
    finally:
        choices.release_all()
        account.end(choices, status)


async def complete(choices: Choices, builder: ResponseBuilder, timeout: float | None,
                   account: Account) -> dict[str, Any]:
    """The non-streaming path of chat and completions."""
    await run_to_end(choices, timeout, account)
    return builder.final(choices)


class ConsumerGone(Exception):
    pass


class Account(Protocol):
    """A request's accounting (``gateway.pipeline.admission.RequestAccount``): ``finish`` when it completed, before the
    final chunk; ``end`` on every path (a no-op after ``finish``)."""

    async def finish(self, choices: Choices) -> None: ...

    def end(self, choices: Choices, status: str) -> None: ...


class SSEBody:
    """The streaming response body: drains the producer's channel. Closing it cancels the producer."""

    def __init__(self, events: trio.MemoryReceiveChannel[str], producer_scope: trio.CancelScope) -> None:
        self._events = events
        self._scope = producer_scope

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return (await self._events.receive()).encode()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        # No checkpoint here: Quart calls this while the connection's scope is already cancelled.
        self._scope.cancel()
        self._events.close()


class EventProducer:
    """The task side of one stream (chat and completion chunks here, Responses events in
    ``gateway.responses.run``); run it with ``nursery.start_soon(producer.run)``. A subclass writes ``_stream``
    (its events, through ``_put``) and ``_fail`` (what a failure after the 200 looks like)."""

    def __init__(self, choices: Choices, timeout: float | None, ping_interval: float, stall_timeout: float,
                 account: Account) -> None:
        self.choices = choices
        self.timeout, self.ping_interval, self.stall_timeout = timeout, ping_interval, stall_timeout
        self.account = account
        self.status = "cancelled"  # the ledger's word for this stream unless it completes or fails
        self.scope = trio.CancelScope()
        self._send, self.events = trio.open_memory_channel[str](SSE_BUFFER)
        self._last_put = trio.current_time()

    def body(self) -> SSEBody:
        return SSEBody(self.events, self.scope)

    async def _put(self, event: str) -> None:
        with trio.move_on_after(self.stall_timeout):
            await self._send.send(event)
            self._last_put = trio.current_time()
            return
        raise ConsumerGone()

    async def run(self) -> None:
        try:
            with self.scope:
                async with self._send:
                    try:
                        await self._stream()
                    except Exception:  # a bug in one stream ends that stream, never the app's nursery
                        log.exception("stream %s failed", self.choices.request_id)
                        self.status = "internal_error"
                        await self._fail(APIError(500, "internal error while streaming", code="internal_error"))
        finally:
            self.choices.release_all()
            self.account.end(self.choices, self.status)

    async def _stream(self) -> None:
        raise NotImplementedError

    async def _fail(self, err: APIError) -> None:
        raise NotImplementedError

    async def _ping(self) -> None:
        if trio.current_time() - self._last_put < self.ping_interval:
            return  # something was sent lately (by any sequence of this stream): the connection is alive
        try:
            self._send.send_nowait(PING)
            self._last_put = trio.current_time()
        except trio.WouldBlock:
            pass  # the client has not even read the last events: it needs no keep-alive


class StreamProducer(EventProducer):
    """A chat or completion stream: chunks, then the usage chunk when asked for, then ``[DONE]``."""

    def __init__(self, choices: Choices, builder: ResponseBuilder, timeout: float | None, ping_interval: float,
                 stall_timeout: float, account: Account) -> None:
        super().__init__(choices, timeout, ping_interval, stall_timeout, account)
        self.builder = builder

    async def _emit(self, _: Child, d: Delta) -> None:
        # follow_all has released the sequence when d ends it (aborting it on the worker after a stop string)
        if d.finish_reason is not None and self.choices.finished:
            await self.account.finish(self.choices)  # durable in the ledger before the client sees the end
        for chunk in self.builder.delta_chunks(d):
            await self._put(sse_event(chunk))

    async def _stream(self) -> None:
        try:
            for index in range(self.choices.num_returned):
                first = self.builder.first_chunk(index)
                if first is not None:
                    await self._put(sse_event(first))
            with _deadline(self.timeout):
                await follow_all(self.choices, self._emit, self._ping, self.ping_interval)
            if self.builder.req.include_usage:
                await self._put(sse_event(self.builder.usage_chunk(self.choices)))
            await self._put(DONE)
        except (trio.BrokenResourceError, ConsumerGone):
            return  # the client is gone: nothing to tell it
        except trio.TooSlowError:
            self.status = "timeout"
            await self._fail(APIError(504, "the request timed out", code="timeout"))
        except RequestFailed as e:
            self.status = e.code
            await self._fail(failure_to_api_error(e))

    async def _fail(self, err: APIError) -> None:
        # After the stream started the status is already 200: an error event, then [DONE].
        log.info("stream %s failed: %s (%s)", self.choices.request_id, err.code, err.status)
        try:
            with trio.move_on_after(1.0):
                await self._send.send(sse_event(err.body()))
                await self._send.send(DONE)
        except trio.BrokenResourceError:
            pass
