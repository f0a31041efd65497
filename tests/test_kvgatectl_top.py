"""``kvgatectl top`` (console/top.py): the view computed from two hand-written expositions, and the command through
Typer's CliRunner against a real HTTP server on 127.0.0.1 whose counters advance on every scrape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from console.kvgatectl import app
from console.top import Snapshot, TopView, compute_view, parse_exposition, render_view
from tests.test_gateway_support import free_port

URL = "http://gw"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVGATE_DB", "KVGATE_URL", "KVGATE_ADMIN_TOKEN", "KVGATE_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # Rich tables: no folding in the assertions' way


def exposition(n: int, *, cost: bool = False) -> str:
    """The gateway's /metrics after ``n`` steps: two expositions concatenated, as the gateway serves them,
    with counter TYPE lines that name ``..._total`` and some that name the family without it."""
    text = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="smollm2",worker="w0"}} {3 + n}
vllm:num_requests_waiting{{model_name="smollm2",worker="w0"}} 1
vllm:kv_cache_usage_perc{{model_name="smollm2",worker="w0"}} 0.25
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{model_name="smollm2",worker="w0"}} {2 + n}
vllm:prefix_cache_queries_total{{model_name="smollm2",worker="w0"}} {1000 + 200 * n}
vllm:prefix_cache_hits_total{{model_name="smollm2",worker="w0"}} {640 + 150 * n}
vllm:prompt_tokens_total{{model_name="smollm2",worker="w0"}} {5000 + 400 * n}
vllm:generation_tokens_total{{model_name="smollm2",worker="w0"}} {800 + 100 * n}
kvgate:workers_ready{{model_name="smollm2"}} 1
kvgate:worker_health{{model_name="smollm2",worker="w0",state="idle"}} 0
kvgate:worker_health{{model_name="smollm2",worker="w0",state="busy"}} 0
kvgate:worker_health{{model_name="smollm2",worker="w0",state="slow"}} 1
kvgate:worker_step_seconds{{model_name="smollm2",worker="w0"}} 2.5
# TYPE kvgate:requests counter
kvgate:requests_total{{route="/v1/completions",status="200",tenant="demo"}} {12.0 + 4 * n}
kvgate:requests_total{{route="/v1/chat/completions",status="429",tenant="demo"}} {1.0 + n}
kvgate:requests_total{{route="/v1/completions",status="401",tenant=""}} 5.0
kvgate:requests_total{{route="/v1/completions",status="200",tenant="acme"}} 7.0
# TYPE kvgate:rejected_requests counter
kvgate:rejected_requests_total{{reason="rate_limit_exceeded",tenant="demo"}} {3.0 + n}
kvgate:rejected_requests_total{{reason="budget_exhausted",tenant="demo"}} 9.0
# TYPE kvgate:streams_in_flight gauge
kvgate:streams_in_flight{{tenant="demo"}} 2.0
# TYPE kvgate:tokens counter
kvgate:tokens_total{{kind="prompt",tenant="demo"}} {900.0 + 30 * n}
kvgate:tokens_total{{kind="cached",tenant="demo"}} 64.0
kvgate:tokens_total{{kind="completion",tenant="demo"}} {300.0 + 20 * n}
"""
    if cost:
        text += '# TYPE kvgate:cost_per_1k_tokens gauge\nkvgate:cost_per_1k_tokens{model_name="smollm2"} 0.002\n'
    return text


def view_of(before: str, after: str, dt: float = 2.0) -> TopView:
    return compute_view(URL, parse_exposition(before, 100.0), parse_exposition(after, 100.0 + dt))


def test_view_rates_gauges_and_hit_rate() -> None:
    view = view_of(exposition(0), exposition(1, cost=True))
    assert (view.url, view.interval_s, view.workers_ready) == (URL, 2.0, 1.0)
    assert view.cost_per_1k_tokens == {"smollm2": 0.002}
    [w] = view.workers
    assert (w.worker, w.model, w.running, w.waiting, w.kv_cache_usage) == ("w0", "smollm2", 4.0, 1.0, 0.25)
    assert (w.prompt_tokens_per_s, w.generation_tokens_per_s) == (200.0, 50.0)
    assert (w.preemptions, w.preemptions_per_s, w.prefix_cache_hit_rate) == (3.0, 0.5, 0.75)
    assert (w.health, w.step_seconds) == ("slow", 2.5)  # a long step with heartbeats: shown as load
    assert view.output_tokens_per_s == 50.0
    assert [t.tenant for t in view.tenants] == ["acme", "demo"]  # the "" tenant (no tenant known) is left out
    acme, demo = view.tenants
    assert (demo.requests_per_s, demo.prompt_tokens_per_s, demo.completion_tokens_per_s) == (2.5, 15.0, 10.0)
    assert (demo.streams_in_flight, demo.rejected_per_s, demo.rejected) == (2.0, 0.5, 13.0)
    # budget_exhausted has more rejections overall, rate_limit_exceeded the only ones in the interval
    assert demo.top_reject_reason == "rate_limit_exceeded"
    assert (acme.requests_per_s, acme.prompt_tokens_per_s, acme.streams_in_flight) == (0.0, None, None)
    assert (acme.rejected, acme.rejected_per_s, acme.top_reject_reason) == (None, None, None)


def test_top_reason_without_recent_rejections_is_the_largest_overall() -> None:
    view = view_of(exposition(0), exposition(0))
    demo = view.tenants[1]
    assert (demo.rejected_per_s, demo.top_reject_reason) == (0.0, "budget_exhausted")


def test_counter_reset_counts_as_zero_and_no_queries_means_no_hit_rate() -> None:
    view = view_of(exposition(3), exposition(0), dt=1.0)  # the worker (and the gateway) restarted
    [w] = view.workers
    assert (w.prompt_tokens_per_s, w.generation_tokens_per_s, w.preemptions_per_s) == (0.0, 0.0, 0.0)
    assert w.prefix_cache_hit_rate is None and w.preemptions == 2.0
    assert view.tenants[1].requests_per_s == 0.0 and view.output_tokens_per_s == 0.0


def test_new_series_counts_from_zero() -> None:
    before = 'vllm:num_requests_running{model_name="m",worker="w0"} 0\n'
    after = before + ('vllm:generation_tokens_total{model_name="m",worker="w0"} 30\n'
                      'kvgate:requests_total{route="/v1/completions",status="200",tenant="new"} 3\n')
    view = view_of(before, after, dt=3.0)
    assert view.workers[0].generation_tokens_per_s == 10.0 and view.tenants[0].requests_per_s == 1.0


def test_missing_metrics_and_first_sample() -> None:
    only = ('vllm:num_requests_running{model_name="m",worker="w1"} 2\n# TYPE x gauge\nx NaN\n'
            # the gateway's own per-worker histograms outlive a dead worker: not a worker row
            'vllm:e2e_request_latency_seconds_count{model_name="m",worker="w9"} 4\n')
    view = view_of(only, only)
    [w] = view.workers
    assert (w.worker, w.running, w.waiting, w.kv_cache_usage, w.preemptions) == ("w1", 2.0, None, None, None)
    assert (w.generation_tokens_per_s, w.prefix_cache_hit_rate, w.health, w.step_seconds) == (None,) * 4
    assert (view.workers_ready, view.output_tokens_per_s, view.cost_per_1k_tokens, view.tenants) == (
        None, None, {}, [])
    first = compute_view(URL, None, parse_exposition(exposition(0), 5.0))
    assert first.interval_s is None and first.output_tokens_per_s is None
    assert first.workers[0].running == 3.0 and first.workers[0].generation_tokens_per_s is None
    assert first.tenants[1].rejected == 12.0 and first.tenants[1].requests_per_s is None
    empty = compute_view(URL, None, Snapshot(1.0, {}))
    assert (empty.workers, empty.tenants, empty.workers_ready) == ([], [], None)


def test_render_shows_the_numbers() -> None:
    console = Console(width=200, record=True, highlight=False)
    console.print(render_view(view_of(exposition(0), exposition(1, cost=True))))
    screen = console.export_text()
    for text in ("w0", "smollm2", "25.0%", "75.0%", "demo", "acme", "rate_limit_exceeded", "smollm2=0.002",
                 "output 50.0 tok/s"):
        assert text in screen, text


# --- the command against a real HTTP server ----------------------------------------------------------------

@pytest.fixture
def gateway() -> Iterator[str]:
    """/metrics whose counters advance one step per scrape."""
    scrapes = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = exposition(scrapes[0], cost=True).encode()
            scrapes[0] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep pytest's output clean

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def test_top_once_json(gateway: str) -> None:
    result = invoke("--url", gateway, "top", "--once", "--interval", "0.2", "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    dt = view["interval_s"]
    assert dt >= 0.2 and view["url"] == gateway and view["workers_ready"] == 1.0
    assert view["cost_per_1k_tokens"] == {"smollm2": 0.002}
    [w] = view["workers"]
    assert (w["worker"], w["running"], w["kv_cache_usage"], w["preemptions"]) == ("w0", 4.0, 0.25, 3.0)
    assert w["prefix_cache_hit_rate"] == 0.75
    assert w["generation_tokens_per_s"] == pytest.approx(100 / dt)
    assert w["prompt_tokens_per_s"] == pytest.approx(400 / dt)
    assert view["output_tokens_per_s"] == pytest.approx(100 / dt)
    demo = view["tenants"][1]
    assert (demo["tenant"], demo["rejected"], demo["top_reject_reason"]) == ("demo", 13.0, "rate_limit_exceeded")
    assert demo["requests_per_s"] == pytest.approx(5 / dt) and demo["completion_tokens_per_s"] == pytest.approx(20 / dt)


def test_top_once_table_and_local_url(gateway: str) -> None:
    result = invoke("top", "--url", gateway, "--once", "--interval", "0.2")
    assert result.exit_code == 0, result.output
    for text in ("w0", "smollm2", "demo", "acme", "75.0%", gateway):
        assert text in result.stdout, text


def test_top_live_iterations(gateway: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_URL", gateway)
    result = invoke("top", "--interval", "0.1", "--iterations", "2")
    assert result.exit_code == 0, result.output
    assert "w0" in result.stdout and "demo" in result.stdout


def test_top_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = invoke("--url", url, "top", "--once", "--interval", "0.1")
    assert result.exit_code == 1
    assert "error: gateway unreachable" in result.stderr and url in result.stderr


def test_top_unreachable_live_keeps_running() -> None:
    result = invoke("--url", f"http://127.0.0.1:{free_port()}", "top", "--interval", "0.1", "--iterations", "2")
    assert result.exit_code == 0, result.output
    assert "gateway unreachable" in result.stdout


def test_top_http_error(gateway: str) -> None:
    result = invoke("--url", gateway + "/nowhere", "top", "--once", "--interval", "0.1", "--json")
    assert result.exit_code == 1 and "error: gateway answered 404" in result.stderr


def test_top_needs_a_url() -> None:
    result = invoke("top", "--once")
    assert result.exit_code == 2 and "--url" in result.output
