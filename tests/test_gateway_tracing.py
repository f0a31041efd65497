"""OpenTelemetry traces: the span tree of one streamed request through a gateway run in this process (so an
in-memory exporter sees its spans) with a real worker subprocess; units for what a live request cannot show
on demand (preemption events, aborts, the trace context handed to the worker)."""

from __future__ import annotations

import argparse
import json
import queue
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.cli import add_serve_parser, config_from_args
from gateway.pipeline.generation import OutputAssembler
from gateway.server import serve
from gateway.telemetry.tracing import RequestTrace
from ipc.messages import EngineTimings
from tenancy.models import UsageRow
from tenancy.store import open_store
from tests.test_gateway_support import ADMIN_TOKEN, MAX_MODEL_LEN, MODEL, free_port

pytestmark = pytest.mark.timeout(180)
CANARY = "okapi-canary-41d2"


class InProcessGateway:
    """``gateway.server.serve`` on its own Trio thread, with an in-memory span exporter."""

    def __init__(self, model_dir: Path, db: Path) -> None:
        self.exporter = InMemorySpanExporter()
        port = free_port()
        parser = argparse.ArgumentParser()
        add_serve_parser(parser.add_subparsers(dest="command"))
        self.cfg = config_from_args(parser.parse_args([
            "serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
            "--served-model-name", MODEL, "--db", str(db), "--admin-token", ADMIN_TOKEN, "--no-demo-tenant",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "16384"]))
        self.url = f"http://127.0.0.1:{port}"
        self._started: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                info = await nursery.start(partial(serve, self.cfg, handle_signals=False,
                                                   span_exporter=self.exporter))
                self._started.put((trio.lowlevel.current_trio_token(), info["stop"]))
        except BaseException as e:
            self._started.put(e)
            raise

    def __enter__(self) -> InProcessGateway:
        self._thread.start()
        started = self._started.get(timeout=90)
        if isinstance(started, BaseException):
            raise started
        self._token, self._stop = started
        for _ in range(900):
            if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                return self
            trio.from_thread.run_sync(lambda: None, trio_token=self._token)  # still alive
            threading.Event().wait(0.1)
        raise TimeoutError("in-process gateway not ready")

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessGateway]:
    with InProcessGateway(tiny_model_dir, tmp_path_factory.mktemp("trace") / "kvgate.db") as g:
        yield g


def _key(gw: InProcessGateway, tenant: str) -> tuple[str, str]:
    store, _ = open_store(gw.cfg.tenancy.db_path)
    try:
        t = store.create_tenant(tenant, 1.0)
        _, key = store.create_key(tenant, "trace")
    finally:
        store.close()
    return t.id, key


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    by_name = {s.name: s for s in kids}
    assert len(by_name) == len(kids), [s.name for s in kids]  # one span per name
    return by_name


def _start(s: ReadableSpan) -> int:
    assert s.start_time is not None
    return s.start_time


def _end(s: ReadableSpan) -> int:
    assert s.end_time is not None
    return s.end_time


def test_span_tree_of_one_streamed_request(gw: InProcessGateway) -> None:
    tenant_id, key = _key(gw, "traced")
    gw.exporter.clear()
    body = {"model": MODEL, "prompt": f"tell me about {CANARY}", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    usage = json.loads([ln for ln in r.text.splitlines() if '"usage"' in ln and '"choices":[]' in ln][0][6:])["usage"]
    spans = list(gw.exporter.get_finished_spans())  # the root ended before the final chunk left

    [root] = [s for s in spans if s.parent is None]
    assert root.name == "POST /v1/completions" and root.kind == SpanKind.SERVER
    assert {s.context.trace_id for s in spans if s.context} == {root.context.trace_id if root.context else 0}
    a = root.attributes or {}
    assert a["kvgate.tenant_id"] == tenant_id and a["gen_ai.request.model"] == MODEL
    assert a["http.response.status_code"] == 200 and a["kvgate.stream"] is True
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert a["kvgate.usage.cached_tokens"] == 0 and a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["kvgate.worker"] == "w0" and root.status.status_code != StatusCode.ERROR

    kids = _children(spans, root)
    assert set(kids) == {"auth", "tokenize", "quota", "queue", "worker"}
    order = [kids[n] for n in ("auth", "tokenize", "quota", "queue")]
    for before, after in zip(order, order[1:]):
        assert _end(before) <= _start(after)  # the gateway's steps, one after the other
    [first_token] = [e for e in root.events if e.name == "first_token"]
    assert _end(kids["queue"]) <= first_token.timestamp <= _end(root)

    worker = kids["worker"]
    assert (worker.attributes or {})["kvgate.worker"] == "w0"
    assert _start(kids["queue"]) <= _start(worker) and _end(worker) <= _end(root)
    phases = _children(spans, worker)
    assert list(phases) == ["worker.queue", "worker.prefill", "worker.decode"]
    q, p, d = phases.values()
    assert _start(q) == _start(worker) and _end(q) == _start(p) and _end(p) == _start(d)
    assert _end(d) == _end(worker) and _end(d) > _start(d)  # four decode steps take time
    # The worker's phases are placed by the arrival of the last output, so the IPC delays of the first and the
    # last token differ by a little: the worker's first token is near, not exactly before, the gateway's.
    assert abs(_end(p) - first_token.timestamp) < 0.25e9

    dumped = "".join(s.to_json() for s in spans)
    assert CANARY not in dumped and "tell me" not in dumped


def test_a_refused_request_is_one_short_trace(gw: InProcessGateway) -> None:
    gw.exporter.clear()
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": CANARY},
                   headers={"Authorization": "Bearer kvg-not-a-key"}, timeout=30)
    assert r.status_code == 401
    spans = list(gw.exporter.get_finished_spans())
    [root] = [s for s in spans if s.parent is None]
    assert (root.attributes or {})["http.response.status_code"] == 401
    assert set(_children(spans, root)) == {"auth"}
    assert _children(spans, root)["auth"].status.status_code == StatusCode.ERROR


# ---- units ------------------------------------------------------------------------------------------


@pytest.fixture
def tracer_and_spans() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return ""


def _row(status: str) -> UsageRow:
    return UsageRow("r1", "t1", "k1", MODEL, 10, 0, 3, status, 0.0, 1.0, 5.0, 20.0)


def test_preemptions_become_events_at_their_offsets(tracer_and_spans: tuple[Any, InMemorySpanExporter]) -> None:
    tracer, exporter = tracer_and_spans
    rt = RequestTrace(tracer, "POST", "/v1/completions")
    rt.admitted("r1", "t1", MODEL, stream=False)
    asm = OutputAssembler(_Tok(), (), False)  # type: ignore[arg-type]
    asm.engine_timings = EngineTimings(scheduled=0.5, first_token=2.0, finished=3.0, preempted=[1.0, 1.5])
    asm.engine_timings_at = 1000.0
    rt.request_ended(_row("length"), asm, "w3")
    assert not [s for s in exporter.get_finished_spans() if s.parent is None]  # the handler still holds it
    rt.http_done(200)
    spans = list(exporter.get_finished_spans())
    [worker] = [s for s in spans if s.name == "worker"]
    assert (worker.attributes or {})["kvgate.preemptions"] == 2
    offsets = [(e.timestamp - _start(worker)) / 1e9 for e in worker.events if e.name == "preemption"]
    assert offsets == pytest.approx([1.0, 1.5], abs=1e-6)
    phases = {s.name: (_end(s) - _start(s)) / 1e9 for s in spans if s.name.startswith("worker.")}
    assert phases == pytest.approx({"worker.queue": 0.5, "worker.prefill": 1.5, "worker.decode": 1.0}, abs=1e-6)


@pytest.mark.parametrize(("status", "stop_string", "reason"), [
    ("cancelled", False, "client_disconnected"), ("timeout", False, "timeout"),
    ("worker_died", False, "worker_died"), ("stop", True, "stop_string"), ("length", False, None)])
def test_abort_event_names_why(tracer_and_spans: tuple[Any, InMemorySpanExporter], status: str,
                               stop_string: bool, reason: str | None) -> None:
    tracer, exporter = tracer_and_spans
    rt = RequestTrace(tracer, "POST", "/v1/chat/completions")
    rt.admitted("r1", "t1", MODEL, stream=True)
    rt.http_done(None)  # the client left before any response: the handler let go first
    asm = OutputAssembler(_Tok(), (), False)  # type: ignore[arg-type]
    asm.hit_stop_string = stop_string
    rt.request_ended(_row(status), asm, "w0")
    [root] = [s for s in exporter.get_finished_spans() if s.parent is None]
    aborts = [dict(e.attributes or {}) for e in root.events if e.name == "abort"]
    assert aborts == ([] if reason is None else [{"kvgate.abort.reason": reason}])
    failed = status not in ("stop", "length")
    assert (root.status.status_code == StatusCode.ERROR) is failed
    assert not [s for s in exporter.get_finished_spans() if s.name == "worker"]  # no engine timings came


def test_generate_carries_the_queue_spans_trace_context(tracer_and_spans: tuple[Any, InMemorySpanExporter]) -> None:
    tracer, exporter = tracer_and_spans
    rt = RequestTrace(tracer, "POST", "/v1/completions")
    with rt.phase("queue") as span:
        carrier = rt.context_for(span)
    ctx = span.get_span_context()
    assert carrier["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")


def test_otlp_endpoint_receives_the_spans(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``--otlp-endpoint``: a real ``kvgate serve`` exports over OTLP/HTTP (protobuf) to a local collector;
    the batch is flushed at the latest when the gateway stops."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.test_gateway_support import start_server

    received: list[tuple[str, str]] = []  # (path, span name)

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            data = self.rfile.read(int(self.headers["Content-Length"]))
            req = ExportTraceServiceRequest.FromString(data)
            received.extend((self.path, span.name) for rs in req.resource_spans for ss in rs.scope_spans
                            for span in ss.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--otlp-endpoint", endpoint)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        srv.stop()
        collector.shutdown()
    names = [name for path, name in received if path == "/v1/traces"]
    assert names.count("POST /v1/completions") == 1
    assert {"auth", "tokenize", "quota", "queue", "worker", "worker.prefill"} <= set(names)
