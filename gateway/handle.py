"""One in-flight request as the gateway sees it: the outputs its worker sent, or why it failed.

The pool's receive loop must never block on a slow client, so it only appends to ``RequestHandle`` (sync,
O(1)); the request's consumer (a route handler or an SSE producer task) takes everything pending at once.
Outputs travel in a Trio memory channel, bounded by construction: a worker sends at most ``max_tokens`` tokens
for a request.
"""

from __future__ import annotations

import math

import trio

from ipc.messages import RequestOutputMsg


class RequestFailed(Exception):
    """The request cannot go on: its worker died, refused it, or it timed out. ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestHandle:
    def __init__(self, request_id: str, worker_id: str, prompt_len: int) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.prompt_len = prompt_len
        self.started = trio.current_time()
        self.finished = False  # the worker sent a finish_reason (its KV blocks are already free)
        self.released = False  # the pool no longer routes outputs here
        self.last_token_at: float | None = None  # trio time the last token-bearing output arrived (for ITL)
        self._failure: RequestFailed | None = None
        # Unbounded on purpose, bounded by construction: the pool's receive loop must never wait on one slow
        # client, and a worker sends at most one output per generated token (max_tokens) plus the finish.
        self._tx, self._rx = trio.open_memory_channel[RequestOutputMsg](math.inf)

    # ---- producer side (the pool; sync, never blocks) ------------------------------------------

    def push(self, out: RequestOutputMsg) -> None:
        if self.finished or self._failure is not None:
            return  # late frames after a finish or failure carry nothing we can still use
        try:
            self._tx.send_nowait(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the consumer is gone
        if out.finish_reason is not None:
            self.finished = True
            self._tx.close()  # the consumer drains what is left, then sees the end

    def fail(self, code: str, message: str) -> None:
        if self.finished or self._failure is not None:
            return
        self._failure = RequestFailed(code, message)
        self._tx.close()

    def close(self) -> None:
        """The consumer is done (called by the pool's release): drop what nobody will read."""
        self._rx.close()

    # ---- consumer side ------------------------------------------------------------------------

    async def next_outputs(self) -> list[RequestOutputMsg]:
        """Everything the worker sent since the last call (waits for at least one output).

        Raises RequestFailed once pending outputs are consumed and the request has failed."""
        try:
            outs = [await self._rx.receive()]
        except trio.EndOfChannel:
            raise self._failure or RequestFailed("internal_error", "no output after the request finished") from None
        while True:
            try:
                outs.append(self._rx.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return outs

    def num_pending(self) -> int:
        return self._rx.statistics().current_buffer_used

    def has_pending(self) -> bool:
        return self.num_pending() > 0 or self._failure is not None
