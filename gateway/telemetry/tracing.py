"""OpenTelemetry traces: one span per generation request, from the HTTP edge through the worker.

The tree of one request (``RequestTrace``)::

    POST /v1/completions            SERVER; tenant, model, token counts, cached tokens, finish reason
      auth | tokenize | quota       the gateway's own steps, in that order
      queue                         picking a worker and handing it the request (trace context goes along)
      worker                        the request's life on its worker, with a preemption event per preemption
        worker.queue | worker.prefill | worker.decode
    events on the root: first_token, abort (client gone, stop string, timeout, worker lost)

The worker spans are built by the gateway from the engine's timings in the request's last output (offsets
since the worker received it), placed on the gateway's clock where that output arrived: like vLLM V1's
frontend, so workers need no exporter and remote workers' clocks need not agree with ours. Requests the
gateway stops itself (a stop string, a client gone) end before their last output: they have no worker spans.

No span or attribute ever carries prompt or completion text. Without an exporter the tracer is OTel's no-op
one and every call here is a few attribute lookups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ipc.messages import EngineTimings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from tenancy.models import UsageRow

log = logging.getLogger("kvgate.gateway.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()
_COMPLETED = ("stop", "length")  # ledger statuses of requests that ended normally


class EndedRequest(Protocol):
    """What the trace reads of a request's outputs (``gateway.pipeline.choices.Choices``, or one sequence's
    ``OutputAssembler``): for several sequences the first one's engine timings make the worker spans."""

    @property
    def finish_reasons(self) -> list[str | None]: ...

    @property
    def first_token_at(self) -> float | None: ...

    @property
    def hit_stop_string(self) -> bool: ...

    @property
    def engine_timings(self) -> EngineTimings | None: ...

    @property
    def engine_timings_at(self) -> float | None: ...


class Tracing:
    """The gateway's tracer and what must be flushed at exit. A private provider (never the global one),
    so tests and embedders can run several gateways in one process."""

    def __init__(self, endpoint: str | None = None, exporter: SpanExporter | None = None,
                 service_name: str = "kvgate-gateway") -> None:
        self._provider = None
        if endpoint is None and exporter is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is not None:  # tests: synchronous, so a finished request's spans are there at once
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        if endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # The batch processor exports from its own thread, off the event loop; a slow collector drops
            # spans (bounded queue) rather than slowing requests.
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
            log.info("exporting traces over OTLP/HTTP to %s", endpoint)
        self._provider = provider
        self.tracer = provider.get_tracer("kvgate.gateway")

    def start_request(self, method: str, route: str) -> RequestTrace:
        return RequestTrace(self.tracer, method, route)

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop the export thread."""
        if self._provider is not None:
            self._provider.shutdown()


class RequestTrace:
    """The spans of one request. Its root ends when both the route handler and the request's account are
    done with it (a stream outlives its handler; a plain request's account ends inside it), so every path that
    releases both ends it exactly once."""

    def __init__(self, tracer: trace.Tracer, method: str, route: str) -> None:
        self._tracer = tracer
        self.root = tracer.start_span(f"{method} {route}", kind=SpanKind.SERVER, attributes={
            "http.request.method": method, "http.route": route})
        self._ctx = trace.set_span_in_context(self.root)
        self._holds = {"http"}

    @contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A child span around a step of the gateway (auth, tokenize, quota, queue)."""
        span = self._tracer.start_span(name, context=self._ctx)
        try:
            yield span
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            span.end()

    def context_for(self, span: Span) -> dict[str, str]:
        """W3C trace context naming ``span`` as the parent, for the Generate message."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def admitted(self, request_id: str, tenant_id: str, model: str, stream: bool) -> None:
        """From here the request's account holds the root too (called inside the handler, which holds it)."""
        if not self._holds:
            raise RuntimeError("admitted() after the request's trace ended")
        self._holds.add("account")
        self.root.set_attributes({"kvgate.request_id": request_id, "kvgate.tenant_id": tenant_id,
                                  "gen_ai.request.model": model, "kvgate.stream": stream})

    def http_done(self, status_code: int | None) -> None:
        if status_code is not None and self.root.is_recording():
            self.root.set_attribute("http.response.status_code", status_code)
            if status_code >= 500:
                self.root.set_status(Status(StatusCode.ERROR))
        self._release("http")

    def request_ended(self, row: UsageRow, asm: EndedRequest, worker: str | None) -> None:
        """Called once by the request's account, on every path, with its ledger row."""
        self.root.set_attributes({
            "gen_ai.usage.input_tokens": row.prompt_tokens, "gen_ai.usage.output_tokens": row.completion_tokens,
            "kvgate.usage.cached_tokens": row.cached_tokens, "kvgate.status": row.status})
        if worker is not None:
            self.root.set_attribute("kvgate.worker", worker)
        reasons = [r for r in asm.finish_reasons if r is not None]
        if reasons:
            self.root.set_attribute("gen_ai.response.finish_reasons", reasons)
        if asm.first_token_at is not None:
            self.root.add_event("first_token", timestamp=_wall_ns(asm.first_token_at))
        abort = _abort_reason(row.status, asm)
        if abort is not None:
            self.root.add_event("abort", {"kvgate.abort.reason": abort})
        if row.status not in _COMPLETED:
            self.root.set_status(Status(StatusCode.ERROR, row.status))
        if asm.engine_timings is not None and asm.engine_timings_at is not None and worker is not None:
            self._worker_spans(worker, asm.engine_timings, _wall_ns(asm.engine_timings_at))
        self._release("account")

    def _worker_spans(self, worker: str, t: EngineTimings, received_ns: int) -> None:
        arrived = received_ns - _ns(t.finished)

        def at(offset: float) -> int:
            return arrived + _ns(offset)

        span = self._tracer.start_span("worker", context=self._ctx, start_time=arrived,
                                       attributes={"kvgate.worker": worker, "kvgate.preemptions": len(t.preempted)})
        for offset in t.preempted:
            span.add_event("preemption", timestamp=at(offset))
        ctx = trace.set_span_in_context(span)
        scheduled = t.finished if t.scheduled is None else t.scheduled
        phases = [("worker.queue", 0.0, scheduled)]
        if t.scheduled is not None and t.first_token is not None:
            phases += [("worker.prefill", t.scheduled, t.first_token), ("worker.decode", t.first_token, t.finished)]
        for name, start, end in phases:
            self._tracer.start_span(name, context=ctx, start_time=at(start)).end(end_time=at(end))
        span.end(end_time=at(t.finished))

    def _release(self, hold: str) -> None:
        if hold in self._holds:
            self._holds.discard(hold)
            if not self._holds:
                self.root.end()


def _abort_reason(status: str, asm: EndedRequest) -> str | None:
    if asm.hit_stop_string:
        return "stop_string"  # the gateway stopped the worker: the response itself completed normally
    if status in _COMPLETED:
        return None
    return {"cancelled": "client_disconnected"}.get(status, status)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _wall_ns(monotonic_at: float) -> int:
    """A time.monotonic() reading as wall-clock ns (OTel timestamps are unix ns)."""
    return time.time_ns() - _ns(time.monotonic() - monotonic_at)
