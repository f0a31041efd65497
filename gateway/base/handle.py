"""One in-flight request as the gateway sees it: the outputs its worker sent, or why it failed.

The pool's receive loop must never block on a slow client, so it only appends to ``RequestHandle`` (sync,
O(1)); the request's consumer (a route handler or an SSE producer task) takes everything pending at once.
Outputs travel in a Trio memory channel whose *bytes* are bounded: a client that stops reading while its worker
keeps generating would otherwise make the gateway hold its whole completion (50 stalled readers of 2,000 tokens
with logprobs held 255 MiB). Past ``MAX_PENDING_BYTES`` the request is cut: its pending outputs are dropped, the
pool aborts it on the worker (its KV is freed) and the consumer, if it ever reads again, gets ``client_too_slow``.

Per stream is not enough: 1,000 stalled streams under 1 MiB each hold 1 GiB. A ``PendingBudget`` (one a gateway,
the pool's) bounds the pending bytes of all streams together: an output that would take the total past
``MAX_GATEWAY_PENDING_BYTES`` cuts its stream instead, if that stream already holds more than ``CUTTABLE_BYTES``
(a client that keeps up holds less and is never cut for others' backlog). So the total stays under
``MAX_GATEWAY_PENDING_BYTES + CUTTABLE_BYTES x streams``. A cut stream is billed for every token its worker
generated (``generated_tokens``), not only those its client took.
"""

from __future__ import annotations

import math

import trio

from ipc.messages import RequestOutputMsg

# What one stream may hold that its client has not taken: about 4,300 plain token outputs or 375 with 20 logprobs
# each, many seconds of generation on any machine, so a client that is merely slow on one read never hits it.
MAX_PENDING_BYTES = 1 << 20
# Rough in-memory sizes of an output's Python objects, rounded up from tracemalloc (CPython 3.11): an output with
# one token ~190 bytes, one whose token carries 20 logprob alternatives ~2.7 KB.
_OUTPUT_BYTES, _TOKEN_BYTES, _LOGPROB_BYTES, _ALTERNATIVE_BYTES = 200, 40, 150, 120
# All streams of a gateway together (the global bound): 256 stalled streams at the per-stream bound.
MAX_GATEWAY_PENDING_BYTES = 256 << 20
# A stream holding less than this is never cut for the global bound (a client that reads, between two reads).
CUTTABLE_BYTES = 16 << 10


class PendingBudget:
    """The pending bytes of all of a gateway's streams (owned by the pool; handles add and take back)."""

    def __init__(self, limit: int = MAX_GATEWAY_PENDING_BYTES) -> None:
        self.limit = limit
        self.total = 0
        self.cuts = 0  # streams cut for the global bound (metrics, tests)

    def must_cut(self, holding: int, size: int) -> bool:
        """Whether a stream holding ``holding`` bytes must be cut rather than take ``size`` more."""
        return self.total + size > self.limit and holding > CUTTABLE_BYTES


_UNBOUNDED = PendingBudget(limit=1 << 62)  # for handles made outside a pool (tests, tools)


def output_bytes(out: RequestOutputMsg) -> int:
    """Estimated memory ``out`` holds while pending (a bound's currency, not an exact figure)."""
    size = _OUTPUT_BYTES + _TOKEN_BYTES * len(out.new_token_ids)
    for _, alternatives in out.logprobs or ():
        size += _LOGPROB_BYTES + _ALTERNATIVE_BYTES * len(alternatives)
    for _, _, alternatives in out.prompt_logprobs or ():  # a long prompt's: as much as thousands of tokens'
        size += _LOGPROB_BYTES + _ALTERNATIVE_BYTES * len(alternatives)
    return size


class RequestFailed(Exception):
    """The request cannot go on: its worker died, refused it, or it timed out. ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestHandle:
    def __init__(self, request_id: str, worker_id: str, prompt_len: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES, budget: PendingBudget = _UNBOUNDED,
                 tenant: str = "", weight: float = 1.0, adapter: str | None = None) -> None:
        self.request_id = request_id
        self.adapter = adapter  # the LoRA adapter's registered name, or None (metrics: vllm:lora_requests_info)
        self.worker_id = worker_id
        self.prompt_len = prompt_len
        self.tenant, self.weight = tenant, weight  # the router's per-tenant accounting (cache salt, weight)
        self.started = trio.current_time()
        self.finished = False  # the worker sent a finish_reason (its KV blocks are already free)
        self.released = False  # the pool no longer routes outputs here
        self.last_token_at: float | None = None  # trio time the last token-bearing output arrived (for ITL)
        self.overflowed = False  # its client fell more than max_pending_bytes behind: the pool cuts it
        self._failure: RequestFailed | None = None
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # estimated, of the outputs in the channel (pushed, not yet taken)
        self._budget = budget
        self.generated_tokens = 0  # tokens the worker sent for it, taken or not (what a cut request is billed)
        # No count bound on purpose (the pool's receive loop must never wait on one slow client): push bounds
        # the bytes instead and cuts the request past them.
        self._tx, self._rx = trio.open_memory_channel[RequestOutputMsg](math.inf)

    # ---- producer side (the pool; sync, never blocks) ------------------------------------------

    def push(self, out: RequestOutputMsg) -> None:
        """Queue ``out`` for the consumer. Past the byte bound the request fails as ``client_too_slow`` and
        ``overflowed`` tells the pool to release it (abort it on its worker)."""
        if self.finished or self._failure is not None:
            return  # late frames after a finish or failure carry nothing we can still use
        self.generated_tokens += len(out.new_token_ids)
        size = output_bytes(out)
        if out.finish_reason is None:
            # An output that finds nothing of its stream waiting says nothing of its client: one step's output may
            # pass the bound alone (a prefill chunk's prompt logprobs: 512 tokens with 20 alternatives, 1.3 MB)
            if self._pending_bytes and self._pending_bytes + size > self._max_pending_bytes:
                self._overflow(f"more than {self._max_pending_bytes >> 10} KiB of output waited for it")
                return
            if self._budget.must_cut(self._pending_bytes, size):
                self._budget.cuts += 1
                self._overflow(f"the gateway's {self._budget.limit >> 20} MiB for all waiting output was full, "
                               f"and {self._pending_bytes >> 10} KiB of it waited for this client")
                return
        try:
            self._tx.send_nowait(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the consumer is gone
        self._add_pending(size)
        if out.finish_reason is not None:
            self.finished = True
            self._tx.close()  # the consumer drains what is left, then sees the end

    def fail(self, code: str, message: str) -> None:
        if self.finished or self._failure is not None:
            return
        self._failure = RequestFailed(code, message)
        self._tx.close()

    def _add_pending(self, delta: int) -> None:
        """Every change of ``_pending_bytes`` goes through here, so the budget's total stays their sum."""
        self._pending_bytes += delta
        self._budget.total += delta

    def _overflow(self, why: str) -> None:
        self.overflowed = True
        self.fail("client_too_slow", f"the client read too slowly: {why}, so the request was stopped")
        self._drop_pending()

    def _drop_pending(self) -> None:
        while True:
            try:
                self._rx.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._add_pending(-self._pending_bytes)

    def close(self) -> None:
        """The consumer is done (called by the pool's release): drop what nobody will read."""
        self._rx.close()
        self._add_pending(-self._pending_bytes)

    # ---- consumer side ------------------------------------------------------------------------

    async def next_outputs(self) -> list[RequestOutputMsg]:
        """Everything the worker sent since the last call (waits for at least one output).

        Raises RequestFailed once pending outputs are consumed and the request has failed."""
        try:
            outs = [await self._rx.receive()]
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._failure or RequestFailed("internal_error", "no output after the request finished") from None
        while True:
            try:
                outs.append(self._rx.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._add_pending(-min(self._pending_bytes, sum(output_bytes(o) for o in outs)))
        return outs

    def num_pending(self) -> int:
        return self._rx.statistics().current_buffer_used

    def pending_bytes(self) -> int:
        return self._pending_bytes

    def has_pending(self) -> bool:
        return self.num_pending() > 0 or self._failure is not None
