"""Limits and failures under a live gateway: request deadlines, admission bounds, a worker SIGKILLed
mid-stream, then the gateway itself SIGKILLed.

Uses its own ``kvgate serve`` (module scope, ``--request-timeout 3 --max-queued-requests 2``) because it kills
it. The worker kill must end the stream with an SSE error event within 2 s, the supervisor must bring the
worker back, and after the gateway's SIGKILL no worker process may remain.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_gateway_support import MODEL, Server, alive, start_server, wait_idle
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 3.0
STEP_DELAY_S = 0.002  # 3,000 tokens >= 6 s, twice the deadline


@pytest.fixture(scope="module")
def chaos_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Every step held 2 ms (the worker's drill hook): the long requests below must outlive the 3 s deadline on
    # any machine, and the tiny model alone streamed 3,000 tokens in under 3 s once decode steps ran in C++.
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("chaos") / "gateway.log",
                       "--request-timeout", str(TIMEOUT_S), "--max-queued-requests", "2",
                       env={"KVGATE_DEBUG_STEP_DELAY": str(STEP_DELAY_S)})
    yield srv
    srv.stop()


def _long_stream_body() -> dict[str, object]:
    return {"model": MODEL, "prompt": list(range(1, 200)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _sse_lines(r: httpx.Response) -> Iterator[str]:
    return (ln for ln in r.iter_lines() if ln)


def test_request_timeout_aborts_plain_and_stream(chaos_server: Server) -> None:
    srv = chaos_server
    body = {**_long_stream_body(), "stream": False}
    t0 = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < TIMEOUT_S + 2
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=_long_stream_body(), headers=srv.headers,
                      timeout=30) as r:
        lines = list(_sse_lines(r))
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "timeout"
    wait_idle(srv, within=1.0)  # both were aborted on the worker


def test_admission_bound_answers_503_with_retry_after(chaos_server: Server) -> None:
    srv = chaos_server
    with httpx.Client(timeout=30, headers=srv.headers) as c:
        with c.stream("POST", f"{srv.url}/v1/completions", json=_long_stream_body()) as r1, \
                c.stream("POST", f"{srv.url}/v1/completions", json=_long_stream_body()) as r2:
            assert r1.status_code == r2.status_code == 200
            r3 = c.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r3.status_code == 503 and r3.json()["error"]["code"] == "no_capacity"
            assert int(r3.headers["retry-after"]) >= 1
    wait_idle(srv, within=1.0)


def _restarts(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvgate:worker_restarts_total" and s.labels.get("worker") == "w0")


def test_worker_sigkill_mid_stream_ends_with_error_then_recovers(chaos_server: Server) -> None:
    srv = chaos_server
    [pid] = srv.worker_pids()
    restarts_before = _restarts(srv)
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=_long_stream_body(), headers=srv.headers,
                      timeout=30) as r:
        assert r.status_code == 200
        lines = _sse_lines(r)
        for _ in range(4):
            assert next(lines).startswith("data: {")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
        ended_after = time.monotonic() - killed_at
    assert ended_after < 2.0, f"stream took {ended_after:.2f}s to end after the worker died"
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(ln[6:]) for ln in rest[:-1] if ln.startswith("data: {") and '"error"' in ln]
    assert errors and errors[-1]["error"]["code"] == "worker_died", rest[-3:]
    assert set(errors[-1]["error"]) == {"message", "type", "param", "code"}

    # /ready reflects the loss until the supervisor's restart says Hello again (unless it was very fast)
    _wait_ready_again(srv)
    assert srv.worker_pids() and srv.worker_pids()[0] != pid
    assert _restarts(srv) == restarts_before + 1
    r2 = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=30,
                    json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] >= 1


def _wait_ready_again(srv: Server) -> None:
    """/ready true once the supervisor's restarted worker says Hello (its log tail on failure)."""
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code, lambda code: code == 200, within=60.0,
                   what="/ready true again", interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{srv.log()[-3000:]}") from None


def test_no_worker_means_503_with_retry_after(chaos_server: Server) -> None:
    srv = chaos_server
    [pid] = srv.worker_pids()
    os.kill(pid, signal.SIGKILL)
    # The gateway notices at once (process exit).
    wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code, lambda code: code != 200, within=5.0,
               what="/ready false after the worker died", interval=0.02)
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=30,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    if r.status_code == 503:  # (the restart may already have won the race)
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "no_worker"
    _wait_ready_again(srv)


def test_gateway_sigkill_leaves_no_worker(chaos_server: Server) -> None:
    srv = chaos_server
    pids = srv.worker_pids()
    assert pids
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)
    wait_until(lambda: [p for p in pids if alive(p)], lambda living: not living, within=10.0,
               what="the workers gone with the gateway")
