"""Observability over real HTTP. Logs: JSON lines with one line per finished (or refused) request, carrying
ids, counts and timings, and never the prompt or the completion: a canary string sent every way a request can
carry text (prompt, chat message, stop string, a rejected request, a stream cut off mid-way) appears in no log
line. Metrics: /metrics parsed with prometheus_client's parser moves by exactly a known workload."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tenancy.models import Quota
from tests.tenancy_support import make_tenant

from tests.test_gateway_support import MODEL, Server, start_server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

CANARY = "zebra-canary-7f3a9c"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "gateway.log", "--gpu-hour-cost", "2.5")
    yield s
    s.stop()


def _gateway_json_lines(srv: Server) -> list[dict[str, object]]:
    out = []
    for line in srv.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_canary_never_logged_and_each_request_logs_one_line(srv: Server) -> None:
    h = srv.headers
    comp = f"{srv.url}/v1/completions"
    ok = httpx.post(comp, headers=h, timeout=30, json={
        "model": MODEL, "prompt": f"say {CANARY} please", "max_tokens": 4, "stop": [CANARY], "temperature": 0})
    assert ok.status_code == 200
    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers=h, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 3, "stream": True})
    assert chat.status_code == 200 and "[DONE]" in chat.text
    bad = httpx.post(comp, headers=h, timeout=30, json={"model": MODEL, "prompt": CANARY, "max_tokens": -1})
    assert bad.status_code == 400
    with httpx.stream("POST", comp, headers=h, timeout=30, json={
            "model": MODEL, "prompt": CANARY * 3, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up mid-stream
    # The ledger's rows are in, so the lines are written; let the cut stream's line land too.
    lines = wait_until(lambda: _gateway_json_lines(srv),
                       lambda lines: sum(rec.get("event") == "request_finished" for rec in lines) >= 3,
                       within=5.0, what="three request_finished lines")
    assert CANARY not in srv.log()
    finished = [rec for rec in lines if rec.get("event") == "request_finished"]
    assert sorted(str(rec["status"]) for rec in finished) == ["cancelled", "length", "length"]
    assert {rec["request_id"] for rec in finished} >= {ok.json()["id"]}
    for rec in finished:
        assert rec["tenant_id"] and rec["key_id"] and rec["model"] == MODEL and rec["level"] == "info"
        assert int(str(rec["prompt_tokens"])) > 0 and float(str(rec["latency_ms"])) > 0
    refused = [rec for rec in lines if rec.get("event") == "request_refused"]
    assert [rec["http_status"] for rec in refused] == [400]
    # The worker the gateway started logs JSON lines too (its start-up steps among them).
    assert any(rec.get("logger") == "kvgate.startup" and str(rec["msg"]).startswith("worker w0: ready")
               for rec in lines)


def _samples(srv: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum over the series of ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_metrics_move_by_exactly_a_known_workload(srv: Server) -> None:
    _, a = make_tenant(srv, "metrics-a")
    _, b = make_tenant(srv, "metrics-b", quota=Quota(rpm=1))
    before = _samples(srv)
    comp = f"{srv.url}/v1/completions"
    body = {"model": MODEL, "prompt": list(range(100, 110)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for _ in range(3):
        assert httpx.post(comp, json=body, headers={"Authorization": f"Bearer {a}"}, timeout=30).status_code == 200
    stream = httpx.post(comp, json={**body, "stream": True}, headers={"Authorization": f"Bearer {a}"}, timeout=30)
    assert stream.status_code == 200 and "[DONE]" in stream.text
    codes = [httpx.post(comp, json=body, headers={"Authorization": f"Bearer {b}"}, timeout=30).status_code
             for _ in range(2)]
    assert codes == [200, 429]
    assert httpx.post(comp, json=body, headers={"Authorization": "Bearer kvg-wrong"}).status_code == 401
    after = _samples(srv)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("kvgate:tokens_total", tenant="metrics-a", kind="prompt") == 4 * 10
    assert delta("kvgate:tokens_total", tenant="metrics-a", kind="completion") == 4 * 4
    assert delta("kvgate:tokens_total", tenant="metrics-b", kind="completion") == 4
    assert delta("kvgate:requests_total", route="/v1/completions", status="200", tenant="metrics-a") == 4
    assert delta("kvgate:requests_total", route="/v1/completions", status="429", tenant="metrics-b") == 1
    assert delta("kvgate:rejected_requests_total", tenant="metrics-b", reason="rate_limit_exceeded") == 1
    assert delta("kvgate:auth_failures_total", reason="invalid_api_key") == 1
    assert _value(after, "kvgate:streams_in_flight", tenant="metrics-a") == 0
    w = {"model_name": MODEL, "worker": "w0"}
    assert delta("vllm:request_success_total", finished_reason="length", **w) == 5
    assert delta("vllm:time_to_first_token_seconds_count", **w) == 5
    assert delta("vllm:e2e_request_latency_seconds_count", **w) == 5
    assert delta("vllm:request_generation_tokens_sum", **w) == 5 * 4
    assert delta("vllm:request_prompt_tokens_sum", **w) == 5 * 10


def test_engine_histograms_and_pool_gauges_follow_a_known_workload(srv: Server) -> None:
    """Sequential requests on one worker: every step is one request's, so the engine-side counts are exact."""
    _, key = make_tenant(srv, "metrics-engine")
    before = _samples(srv)
    body = {"model": MODEL, "prompt": list(range(200, 210)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for stream in (False, False, True):
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": stream}, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    after = _samples(srv)

    def delta(name: str) -> float:
        return _value(after, name, model_name=MODEL, worker="w0") - _value(before, name, model_name=MODEL,
                                                                          worker="w0")

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    # The worker's phases of a request lie inside the latency the gateway measured around it.
    engine_s = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < engine_s <= delta("vllm:e2e_request_latency_seconds_sum")
    assert delta("vllm:request_decode_time_seconds_sum") > 0
    # 4 tokens each: one step prefills 10 prompt tokens and samples the first, three decode one token each.
    assert delta("vllm:iteration_tokens_total_count") == 3 * 4
    assert delta("vllm:iteration_tokens_total_sum") == 3 * (10 + 3)
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3  # gaps between 4 tokens
    assert delta("vllm:inter_token_latency_seconds_sum") > 0
    assert _value(after, "kvgate:ipc_pending_outputs", worker="w0") == 0
    # Nothing of this workload was aborted; an abort of an earlier test's hung-up stream stays pending until the
    # worker's next heartbeat confirms it (pool.pending_aborts), so the gauge must come to 0 within a few of them.
    wait_until(lambda: _value(_samples(srv), "kvgate:ipc_pending_aborts", worker="w0"), lambda v: v == 0,
               within=10.0, what="no pending aborts")


def test_cost_per_1k_tokens_is_worker_time_at_the_configured_price_over_billed_tokens(srv: Server) -> None:
    _, key = make_tenant(srv, "metrics-cost")
    r = httpx.post(f"{srv.url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200
    s = _samples(srv)
    worker_s = _value(s, "kvgate:worker_seconds_total", model_name=MODEL)
    assert worker_s > 0
    cost = _value(s, "kvgate:gpu_cost_total", model_name=MODEL)
    assert cost == pytest.approx(worker_s / 3600 * 2.5)
    billed = _value(s, "kvgate:tokens_total", kind="prompt") + _value(s, "kvgate:tokens_total", kind="completion")
    assert billed >= r.json()["usage"]["total_tokens"]
    assert _value(s, "kvgate:cost_per_1k_tokens", model_name=MODEL) == pytest.approx(cost / (billed / 1000))
