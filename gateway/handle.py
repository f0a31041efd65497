"""One in-flight request as the gateway sees it: the outputs its worker sent, or why it failed.

The pool's receive loop must never block on a slow client, so it only appends to ``RequestHandle`` (sync,
O(1)); the request's consumer (a route handler or an SSE producer task) takes everything pending at once.
The buffer is bounded by construction: a worker sends at most ``max_tokens`` tokens for a request.
"""

from __future__ import annotations

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
        self._pending: list[RequestOutputMsg] = []
        self._failure: RequestFailed | None = None
        self._event = trio.Event()

    # ---- producer side (the pool; sync, never blocks) ------------------------------------------

    def push(self, out: RequestOutputMsg) -> None:
        if self.finished or self._failure is not None:
            return  # late frames after a finish or failure carry nothing we can still use
        self._pending.append(out)
        if out.finish_reason is not None:
            self.finished = True
        self._event.set()

    def fail(self, code: str, message: str) -> None:
        if self.finished or self._failure is not None:
            return
        self._failure = RequestFailed(code, message)
        self._event.set()

    # ---- consumer side ------------------------------------------------------------------------

    async def next_outputs(self) -> list[RequestOutputMsg]:
        """Everything the worker sent since the last call (waits for at least one output).

        Raises RequestFailed once pending outputs are consumed and the request has failed."""
        while not self._pending:
            if self._failure is not None:
                raise self._failure
            await self._event.wait()
            self._event = trio.Event()
        outs, self._pending = self._pending, []
        return outs

    def num_pending(self) -> int:
        return len(self._pending)

    def has_pending(self) -> bool:
        return bool(self._pending) or self._failure is not None
