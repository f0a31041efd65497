"""Tenant admission: rate limits, concurrency slots and budgets at the edge, and the accounting of each request.

``QuotaGate`` turns the limiter's decisions into OpenAI-shaped answers (429 ``rate_limit_exceeded`` with an
accurate ``retry-after``; 429 ``insufficient_quota`` with ``x-should-retry: false``; 400 for a request that can
never fit; 503 when a shared limiter is unreachable and the policy is fail-closed). A limiter that does network
I/O (Redis) is called from a worker thread; its settles are queued to a task, so a ``finally`` never blocks.

``RequestAccount`` ends every admitted request exactly once: a completed one writes its ledger row (awaited,
before the final chunk) and settles its reservation to the real token count; any other end (cancel, failure,
timeout) queues a row with what was done and settles too, so slots come back on every path.

A request of several sequences (``n``, ``best_of``) is admitted as one request (one rate-limit request, one
concurrency slot) reserving ``prompt + sequences x max_tokens`` tokens: the prompt is computed once and shared,
each sequence may generate ``max_tokens``. Per-request bounds apply per sequence (``max_tokens_per_request``
bounds each one's ``max_tokens``); tokens per minute and budgets see the whole reservation. Its one ledger row
counts the prompt once and the tokens of every sequence generated.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol, TypeVar

import trio

from gateway.base.errors import APIError
from gateway.base.principal import Principal
from gateway.telemetry.gateway_metrics import GatewayMetrics
from gateway.pipeline.choices import Choices
from gateway.telemetry.tracing import RequestTrace
from tenancy.limiter import Decision, RateLimiter, RateLimitInfo, Scope
from tenancy.limits_spec import never_fits
from tenancy.models import UsageRow

log = logging.getLogger("kvgate.gateway.admission")
T = TypeVar("T")

RENEW_INTERVAL_S = 10.0  # well inside the shared limiter's slot lease, so live requests keep their slots

_CODES = {"rate_limit_exceeded": "rate_limit_exceeded", "concurrency": "concurrency_limit_exceeded",
          "insufficient_quota": "insufficient_quota", "never_fits": "exceeds_quota_limit",
          "unavailable": "rate_limiter_unavailable"}


def denial_error(d: Decision) -> APIError:
    reason = d.reason or "rate_limit_exceeded"
    # OpenAI's type for an exhausted budget is "insufficient_quota"; for the rest the status decides.
    err_type = "insufficient_quota" if reason == "insufficient_quota" else None
    return APIError(d.http_status, d.message or "request refused by quota", code=_CODES.get(reason, reason),
                    err_type=err_type, extra_headers=d.headers())


class QuotaGate:
    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter
        # Unbounded on purpose: a lost settle would hold a tenant's concurrency slot and tokens for good, and
        # settling must stay sync (callable from any ``finally``). At most one per admitted request, so the
        # depth is bounded by admission; exported as kvgate:settle_queue.
        self._settles_tx, self._settles = trio.open_memory_channel[tuple[str, int]](math.inf)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.limiter.blocking:
            return fn(*args)
        # Not abandoned on cancel: a reservation that was made must come back to a caller that settles it. The
        # shared limiter's own socket timeouts bound the wait (it answers "unavailable" past them).
        return await trio.to_thread.run_sync(fn, *args)

    async def admit(self, principal: Principal, request_id: str, prompt_tokens: int, max_tokens: int,
                    sequences: int = 1) -> dict[str, str]:
        """Reserve ``prompt + sequences x max_tokens``; returns the x-ratelimit headers or raises the denial."""
        scopes = sequence_scopes(principal.scopes, prompt_tokens, max_tokens, sequences)
        decision: Decision = await self._call(self.limiter.admit, request_id, scopes, prompt_tokens,
                                              max_tokens * sequences)
        if not decision.allowed:
            if sequences > 1 and decision.reason == "never_fits":
                decision = replace(decision, message=f"{decision.message} ({sequences} sequences of up to "
                                                     f"{max_tokens} tokens each)")
            raise denial_error(decision)
        return decision.info.headers()

    async def headers(self, scopes: Sequence[Scope]) -> dict[str, str]:
        """x-ratelimit headers for a response that spends nothing (best effort: none if the limiter is down)."""
        try:
            info: RateLimitInfo = await self._call(self.limiter.peek, scopes)
        except Exception as e:  # noqa: BLE001 - headers are informative; the request itself must not fail
            log.warning("rate-limit peek failed: %s", type(e).__name__)
            return {}
        return info.headers()

    def settle(self, request_id: str, used_tokens: int) -> None:
        """Sync and safe in any ``finally``: the in-process limiter settles now, a shared one via the task."""
        if not self.limiter.blocking:
            self.limiter.settle(request_id, used_tokens)
            return
        self._settles_tx.send_nowait((request_id, used_tokens))

    @property
    def queued(self) -> int:
        return self._settles.statistics().current_buffer_used

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.limiter.blocking:
                nursery.start_soon(self._settle_loop)
                nursery.start_soon(self._renew_loop)
            task_status.started()

    async def _settle_loop(self) -> None:
        try:
            while True:
                first = await self._settles.receive()
                await self._drain_settles([first])
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await self._drain_settles([])

    async def _drain_settles(self, batch: list[tuple[str, int]]) -> None:
        while True:
            try:
                batch.append(self._settles.receive_nowait())
            except trio.WouldBlock:
                break
        if not batch:
            return

        def settle_all() -> None:
            for request_id, used in batch:
                self.limiter.settle(request_id, used)  # never raises: an unreachable Redis is logged

        await trio.to_thread.run_sync(settle_all)

    async def _renew_loop(self) -> None:
        while True:
            await trio.sleep(RENEW_INTERVAL_S)
            await trio.to_thread.run_sync(self.limiter.renew)


def sequence_scopes(scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int,
                    sequences: int) -> Sequence[Scope]:
    """The scopes to reserve ``sequences`` sequences against, as one request of ``sequences x max_tokens``.

    The limiter checks ``max_tokens_per_request`` against the max_tokens it is given, here the sum; that bound is
    per sequence, so it is checked here against each one's and lifted from what the limiter sees."""
    if sequences == 1:
        return scopes
    never = never_fits(scopes, prompt_tokens, max_tokens)
    if never is not None:
        raise denial_error(Decision(False, "never_fits", message=never))
    return [Scope(s.name, replace(s.quota, max_tokens_per_request=None)) for s in scopes]


class Ledger(Protocol):
    """Where a request's usage row goes: ``gateway.pipeline.ledger.UsageLedger``, or a batch line's capture (its
    row is written with the line's result, ``gateway.batches.line``)."""

    async def record(self, row: UsageRow) -> bool: ...

    def record_nowait(self, row: UsageRow) -> object: ...


class RequestAccount:
    """The ledger row and the reservation of one admitted request; ``finish`` or ``end``, exactly once."""

    def __init__(self, gate: QuotaGate, ledger: Ledger, metrics: GatewayMetrics, principal: Principal,
                 request_id: str, model: str, prompt_tokens: int, trace: RequestTrace, stream: bool, *,
                 prompt_text: str | None = None, tier: str | None = None, adapter: str | None = None) -> None:
        self._gate, self._ledger, self._metrics, self._principal = gate, ledger, metrics, principal
        self.adapter = adapter  # the LoRA adapter's registered name (None: the base model): in the ledger row
        self.tier = tier or principal.tier  # the class it was submitted as (a Batch API line's is batch)
        self.request_id, self.model, self.prompt_tokens = request_id, model, prompt_tokens
        self._prompt_text = prompt_text  # only logged when the tenant opted in (principal.log_text)
        self._trace = trace
        trace.admitted(request_id, principal.tenant_id, model, stream)  # the trace's root now waits for our end
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.worker: str | None = None  # set once a worker got it: from then on every end is billed
        self.done = False

    def _row(self, choices: Choices, status: str, completion_tokens: int) -> UsageRow:
        now = time.monotonic()
        first = choices.first_token_at
        ttft = None if first is None else (first - self.started) * 1000.0
        return UsageRow(self.request_id, self._principal.tenant_id, self._principal.key_id, self.model,
                        self.prompt_tokens, min(choices.cached_tokens, self.prompt_tokens), completion_tokens,
                        status, self.started_wall, time.time(), ttft, (now - self.started) * 1000.0, self.adapter)

    async def finish(self, choices: Choices) -> None:
        """The request completed: its row is durable before this returns (or queued after COMMIT_WAIT_S)."""
        if self.done:
            return
        self.done = True
        row = self._row(choices, choices.finish_reason or "stop", choices.completion_tokens)
        try:
            await self._ledger.record(row)
        finally:
            self._gate.settle(self.request_id, self.prompt_tokens + choices.completion_tokens)
            self._report(row, choices)

    def end(self, choices: Choices, status: str) -> None:
        """Any other end (cancelled, failed, timed out, never submitted). Sync: called from ``finally``."""
        if self.done:
            return
        self.done = True
        used = 0
        row = self._row(choices, status, choices.generated_tokens)  # a cut stream: what its worker generated
        if self.worker is not None:
            self._ledger.record_nowait(row)
            used = self.prompt_tokens + row.completion_tokens
        self._gate.settle(self.request_id, used)
        self._report(row, choices)

    def _report(self, row: UsageRow, choices: Choices) -> None:
        # The tenant's setting decides, not the caller: text handed in for a tenant that is off stays unlogged.
        text = None
        if self._principal.log_text:
            texts = choices.texts
            text = _Text(self._prompt_text, texts if len(texts) > 1 else "".join(texts))
        _log_finished(row, text)
        self._metrics.request_finished(row, self._principal.tenant_name, self.worker, choices.n, choices.best_of)
        if self.worker is not None:
            self._metrics.tier_finished(self.tier, row, [c.asm.engine_timings for c in choices.children])
        self._trace.request_ended(row, choices, self.worker)


class _Text(NamedTuple):
    prompt: str | None  # None when the caller did not hand the prompt's text over
    completion: str | list[str]  # one per returned choice when there are several


def _log_finished(row: UsageRow, text: _Text | None) -> None:
    """One line per finished request: ids, status, counts and timings; prompt and completion text only when the
    tenant opted in (``kvgatectl tenant set-log-text NAME on``), else never."""
    fields: dict[str, Any] = {
        "event": "request_finished", "request_id": row.request_id, "tenant_id": row.tenant_id,
        "key_id": row.key_id, "model": row.model, "status": row.status, "prompt_tokens": row.prompt_tokens,
        "cached_tokens": row.cached_tokens, "completion_tokens": row.completion_tokens,
        "ttft_ms": None if row.ttft_ms is None else round(row.ttft_ms, 1),
        "latency_ms": None if row.latency_ms is None else round(row.latency_ms, 1)}
    if text is not None:
        fields["prompt"], fields["completion"] = text.prompt, text.completion
    log.info("request finished", extra={"fields": fields})
