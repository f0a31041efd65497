"""One batch line, run exactly as a request to its route runs: ``parse_chat``/``parse_completion`` on its body
(``stream`` forced off), the batch key's quotas (``QuotaGate.admit``), ``submit_all`` to the workers, ``complete``,
one ``RequestAccount`` (metrics, trace, the request-finished log line, the limiter's settle). What differs is where
its usage row goes: the account hands it to a capture, and the runner writes it with the line's result in one
transaction (``tenancy.batch_store.put_result``), so the tenant is billed for stored results only, once each.

Refusals that waiting can cure are waited out, never turned into failed lines: a 429 for a rate or concurrency
limit (after its ``retry-after``), a 503 (no capacity, no worker, a worker that died mid-line, an unreachable
limiter or store). A line is *attempted* when it is submitted to a worker; the attempt is recorded before the
submit (and taken back when the pool refuses it, since nothing ran), so a line that keeps killing its worker or
its gateway ends as a failure after ``MAX_ATTEMPTS`` instead of running forever. Every other answer (a body its
route refuses, an exhausted budget, a timeout) is the line's result, as its route would have answered it.

A line's ``body.model`` is resolved as ``check_model`` resolves a request's: the served model, or a LoRA adapter
its tenant may use, looked up again each time the line runs (an adapter unregistered mid-batch fails the lines
that run after, with the route's 404). The adapter goes to the workers, the ledger row and the response's
``model``, as on the routes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from gateway.base.errors import APIError, bad_request, model_not_allowed, model_not_found
from gateway.base.handle import RequestFailed
from gateway.base.principal import Principal
from gateway.batches.objects import failure_line, success_line, unrun_line
from gateway.fleet.pool import WorkerPool, unix_deadline
from gateway.pipeline.adapters import AdapterCatalog
from gateway.pipeline.admission import QuotaGate, RequestAccount
from gateway.pipeline.choices import Choices, prompt_text, submit_all
from gateway.pipeline.protocol import GenerationRequest, parse_chat, parse_completion
from gateway.pipeline.responses import ResponseBuilder
from gateway.pipeline.streaming import complete, failure_to_api_error
from gateway.pipeline.tiering import line_submission
from gateway.pipeline.tokenizer import GatewayTokenizer
from gateway.telemetry.gateway_metrics import GatewayMetrics
from gateway.telemetry.tracing import RequestTrace, Tracing
from tenancy.models import LoraAdapterRecord, UsageRow

# vLLM's per-request priority (lower runs sooner; interactive requests default to 0): batch lines yield to
# interactive traffic in the workers' queues. A line's own "priority" can only lower its precedence further. None:
# send no priority at all (``batch_priority`` also sends none to workers started with --scheduling-policy fcfs,
# which refuse any priority but 0).
BATCH_PRIORITY: int | None = 100
MAX_ATTEMPTS = 3  # submissions of one line that end without a stored result before it fails
RETRY_CAP_S = 30.0  # the longest wait between two tries of a refused line (the runner's stop is checked throughout)


@dataclass(frozen=True)
class Line:
    request_id: str  # the same on every attempt: the worker's and the ledger's id
    custom_id: str
    body: str  # JSON, as stored
    attempts: int  # submissions recorded before this run


@dataclass(frozen=True)
class Outcome:
    result: str  # the output or error file's line
    ok: bool
    usage: UsageRow | None  # the ledger row to write with the result (None: nothing ran on a worker)
    status: int  # the HTTP status its route would have answered


class Marks(Protocol):
    """The line's attempt record in the store."""

    async def mark(self) -> bool:
        """Record an attempt; False when the line has a result already (there is nothing to run)."""

    async def unmark(self) -> None:
        """Take the attempt back (the pool refused the submit: nothing ran)."""


@dataclass(frozen=True)
class Pipeline:
    """What a line needs of the gateway (the routes reach the same pieces through ``GatewayState``)."""

    tokenizer: GatewayTokenizer
    pool: WorkerPool
    quota: QuotaGate
    metrics: GatewayMetrics
    tracing: Tracing
    model: str
    request_timeout: float | None
    priority: int | None  # batch_priority(...): what the lines are sent with
    # The adapters a line's model may name (the routes' catalog); the default, adapters off, serves the base only.
    adapters: AdapterCatalog = field(default_factory=lambda: AdapterCatalog(None))


class _Capture:
    """A line's ledger: keeps its usage row for the runner to store with the result (``admission.Ledger``)."""

    def __init__(self) -> None:
        self.row: UsageRow | None = None

    async def record(self, row: UsageRow) -> bool:
        self.row = row
        return True

    def record_nowait(self, row: UsageRow) -> None:
        self.row = row


class _Retry(Exception):
    def __init__(self, err: APIError) -> None:
        super().__init__(err.message)
        self.err = err


@dataclass
class _Tries:
    attempts: int
    last: APIError | None = None


def batch_priority(scheduling_policy: str | None) -> int | None:
    """The priority batch lines are sent with: ``BATCH_PRIORITY``, unless this gateway starts its workers with
    the fcfs policy (workers started by hand must then run the same policy as the gateway's own)."""
    return None if scheduling_policy == "fcfs" else BATCH_PRIORITY


def is_transient(err: APIError) -> bool:
    return err.status == 503 or (err.status == 429 and err.code != "insufficient_quota")


def prepared_body(raw: str, priority: int | None) -> Any:
    """The line's body as its route gets it: never streamed, and at ``priority`` or later (None: as written)."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        return body  # the file check let only objects in; parse refuses anything else anyway
    body = {**body, "stream": False}
    body.pop("stream_options", None)  # only allowed with stream: true
    if priority is not None:
        given = body.get("priority")
        # A non-integer is left for parse to refuse in its own words.
        if given is None or type(given) is int:
            body["priority"] = priority if given is None else max(given, priority)
    return body


class LineRunner:
    def __init__(self, pipe: Pipeline, stopping: Callable[[], bool]) -> None:
        self._pipe = pipe
        self._stopping = stopping

    async def adapter_for(self, model: str, tenant_id: str) -> LoraAdapterRecord | None:
        """The adapter ``model`` names for this tenant (None: the served model); ``model_not_found`` for any other
        name, another tenant's adapter included (no oracle for what others hold); a 503 when the registry is."""
        if model == self._pipe.model:
            return None
        adapter = await self._pipe.adapters.resolve(model, tenant_id)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    async def run(self, principal: Principal, endpoint: str, line: Line, marks: Marks) -> Outcome | None:
        """The line's outcome, or None: it has a result already, or it could not run before the runner stopped
        (it stays pending for the next run)."""
        tries = _Tries(line.attempts)
        while True:
            try:
                return await self._once(principal, endpoint, line, marks, tries)
            except _Retry as r:
                tries.last = r.err
            if self._stopping():
                return None
            await self._pause(tries.last.retry_after)

    async def _pause(self, retry_after: float | None) -> None:
        deadline = trio.current_time() + min(max(retry_after or 1.0, 0.1), RETRY_CAP_S)
        while trio.current_time() < deadline and not self._stopping():
            await trio.sleep(min(0.25, deadline - trio.current_time()))

    async def _once(self, principal: Principal, endpoint: str, line: Line, marks: Marks,
                    tries: _Tries) -> Outcome | None:
        p = self._pipe
        parse = parse_chat if endpoint == "/v1/chat/completions" else parse_completion
        max_model_len, cap = p.pool.max_model_len, principal.quota.max_tokens_per_request

        def parsed() -> tuple[Any, GenerationRequest | APIError]:
            body = prepared_body(line.body, p.priority)
            try:
                return body, parse(body, p.tokenizer, max_model_len, cap)
            except APIError as e:
                return body, e  # answered after the model check, which the route makes first

        # Always in a thread (the body's JSON too): a line is never worth a stall of interactive requests.
        body, req = await trio.to_thread.run_sync(parsed)
        try:
            adapter = await self._model(principal, body)
        except APIError as e:
            if is_transient(e):  # the adapter registry did not answer: waited out
                raise _Retry(e) from None
            return _failed(line, e, None)
        if isinstance(req, APIError):
            return _failed(line, req, None)
        if tries.attempts >= MAX_ATTEMPTS:
            return _exhausted(line, tries)
        rt = p.tracing.start_request("POST", endpoint)
        status: int | None = None  # None: cancelled (the batch expired, the runner stopped)
        try:
            outcome = await self._generate(principal, req, line, marks, tries, rt, adapter)
            status = None if outcome is None else outcome.status
            return outcome
        except _Retry as r:
            status = r.err.status
            raise
        finally:
            rt.http_done(status)

    async def _model(self, principal: Principal, body: Any) -> LoraAdapterRecord | None:
        """``check_model`` for a line: resolved now, not at upload (an adapter may have been unregistered since)."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str):  # the file check lets none in; a body stored before it is answered as so
            raise bad_request("'model' must be a string", param="model")
        adapter = await self.adapter_for(model, principal.tenant_id)
        if not principal.allows_model(model):
            raise model_not_allowed(model)
        return adapter

    async def _admit(self, principal: Principal, req: GenerationRequest, line: Line, rt: RequestTrace) -> None:
        p = self._pipe
        with rt.phase("quota"):
            try:
                await p.quota.admit(principal, line.request_id, req.prompt_tokens, req.max_tokens, req.sequences)
            except APIError as e:
                p.metrics.rejected.labels(principal.tenant_name, e.code or "refused").inc()
                raise

    async def _claim(self, principal: Principal, req: GenerationRequest, line: Line, marks: Marks,
                     rt: RequestTrace) -> Outcome | bool:
        """Admission, then the attempt's record: True to run the line, False when it has a result already, its
        outcome when its quota refuses it for good (a refusal that waiting cures is a ``_Retry``)."""
        p = self._pipe
        try:
            await self._admit(principal, req, line, rt)
        except APIError as e:
            if is_transient(e):
                raise _Retry(e) from None
            return _failed(line, e, None)
        try:
            marked = await marks.mark()
        except BaseException as e:
            p.quota.settle(line.request_id, 0)
            if isinstance(e, APIError):  # the store: a 503, waited out like any other
                raise _Retry(e) from None
            raise
        if not marked:
            p.quota.settle(line.request_id, 0)
        return marked

    async def _generate(self, principal: Principal, req: GenerationRequest, line: Line, marks: Marks, tries: _Tries,
                        rt: RequestTrace, adapter: LoraAdapterRecord | None) -> Outcome | None:
        p = self._pipe
        claimed = await self._claim(principal, req, line, marks, rt)
        if isinstance(claimed, Outcome):
            return claimed
        if not claimed:
            return None
        capture = _Capture()
        sub = line_submission(principal.tier, req.priority, p.priority)  # the batch tier, whatever the tenant's
        account = RequestAccount(p.quota, capture, p.metrics, principal, line.request_id, p.model,
                                 req.prompt_tokens, rt, False, tier=sub.tier,
                                 prompt_text=prompt_text(req, p.tokenizer) if principal.log_text else None,
                                 adapter=None if adapter is None else adapter.name)
        choices = Choices(p.pool, line.request_id, req.n, req.best_of, len(req.prompts()))
        try:
            with rt.phase("queue") as span:
                await submit_all(p.pool, choices, req, p.tokenizer, principal.cache_salt,
                                 unix_deadline(p.request_timeout), principal.weight, rt.context_for(span),
                                 tier=sub.tier, priority=sub.priority, adapter=adapter)
        except BaseException as e:
            choices.release_all()  # those already queued are aborted on their workers
            account.end(choices, "not_submitted")
            err = failure_to_api_error(e) if isinstance(e, RequestFailed) else e
            if not isinstance(err, APIError):
                raise
            with trio.CancelScope(shield=True):
                await _unmark(marks)
            if is_transient(err):
                raise _Retry(err) from None
            return _failed(line, err, None)
        account.worker = choices.worker_id
        tries.attempts += 1
        # As on the routes: the response names the model the line asked for (the adapter, when it is one).
        builder = ResponseBuilder(f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                                  p.model if adapter is None else adapter.name, int(time.time()), req, p.tokenizer,
                                  account.tier)
        try:
            body = await complete(choices, builder, p.request_timeout, account)
        except APIError as e:
            if is_transient(e):  # a worker died under it, the pool drained: its row is dropped, it runs again
                raise _Retry(e) from None
            return _failed(line, e, capture.row)
        return Outcome(success_line(line.request_id, line.custom_id, body), True, capture.row, 200)


async def _unmark(marks: Marks) -> None:
    try:
        with trio.move_on_after(5.0):
            await marks.unmark()
    except APIError:
        pass  # logged by the store call; the line merely counts one attempt too many


def _failed(line: Line, err: APIError, usage: UsageRow | None) -> Outcome:
    return Outcome(failure_line(line.request_id, line.custom_id, err), False, usage, err.status)


def _exhausted(line: Line, tries: _Tries) -> Outcome:
    if tries.last is not None:
        return _failed(line, tries.last, None)
    return Outcome(unrun_line(line.request_id, line.custom_id, "interrupted",
                              f"the request was started {tries.attempts} times and its gateway stopped before its "
                              "result was stored each time; it is not run again"), False, None, 500)
