"""A busy worker is not a dead worker: slow, frozen and reconciled workers under a real ``kvgate serve``.

- slow: every engine step spins 5 s holding the GIL (``KVGATE_DEBUG_STEP_DELAY``), far past the 2 s heartbeat
  timeout; 8 concurrent streams must all complete, no worker may be lost, and the gateway must see the slow
  step in the worker's heartbeats while it runs;
- a client that disconnects during a slow step has its KV blocks freed right after that step;
- frozen: a SIGSTOPped worker is declared frozen within heartbeat_timeout + 1 s, its streams end with an error
  event, and the supervisor kills and restarts it;
- reconciled: an external worker given up on (SIGSTOP past the timeout) that is heard from again (SIGCONT) is
  left holding nothing the gateway does not track, waiting requests included.

Timings here are liveness promises of the product (the heartbeat timeout), never throughput.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_gateway_support import (MAX_MODEL_LEN, MODEL, REPO, Server, alive, deployment_env, finish_start,
                                        free_port, metric_sum, start_server, wait_idle)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 2.0
STEP_DELAY_S = 5.0


def _body(max_tokens: int, prompt_len: int = 40) -> dict[str, object]:
    return {"model": MODEL, "prompt": list(range(1, prompt_len + 1)), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _metrics(srv: Server) -> str:
    return httpx.get(f"{srv.url}/metrics", timeout=10).text


def _stream(srv: Server, body: dict[str, object], results: list[list[str]], timeout: float = 120) -> None:
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=timeout) as r:
        results.append([ln for ln in r.iter_lines() if ln] if r.status_code == 200 else [f"HTTP {r.status_code}"])


def _series(text: str, series: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(series + " "))


def _wait_for(cond: Callable[[], bool], within: float, what: str) -> None:
    wait_until(cond, within=within, what=what)


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("slow") / "gateway.log",
                       "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                       env={"KVGATE_DEBUG_STEP_DELAY": str(STEP_DELAY_S)})
    yield srv
    srv.stop()


def test_slow_steps_serve_eight_streams_without_a_failure(slow_server: Server) -> None:
    srv = slow_server
    results: list[list[str]] = []
    threads = [threading.Thread(target=_stream, args=(srv, _body(3), results)) for _ in range(8)]
    for t in threads:
        t.start()
    seen_slow = False
    while any(t.is_alive() for t in threads):
        text = _metrics(srv)
        seen_slow = seen_slow or 'state="slow"} 1' in text
        time.sleep(0.5)
    assert len(results) == 8
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert not any('"error"' in ln for ln in lines), lines
        chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "length") == 1
    assert seen_slow, "the gateway never saw a step in progress: heartbeats did not arrive during the step"
    text = _metrics(srv)
    assert metric_sum(text, "kvgate:workers_lost_total") == 0
    assert "lost (" not in srv.log()


def test_disconnect_during_a_slow_step_frees_blocks_after_it(slow_server: Server) -> None:
    srv = slow_server
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=_body(50), headers=srv.headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                break  # the first token: the next (5 s) step is running now
    # The gateway releases the stream (and its concurrency slot) at once; the abort reaches the worker's I/O
    # thread at once and is applied when the running step ends: blocks free within one step, not a timeout.
    assert metric_sum(_metrics(srv), "kvgate:streams_in_flight") == 0
    wait_idle(srv, within=STEP_DELAY_S + 3.0)


@pytest.fixture(scope="module")
def plain_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 50 ms steps keep the streams below running for minutes (the tiny model alone would finish them early).
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("freeze") / "gateway.log",
                       "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), env={"KVGATE_DEBUG_STEP_DELAY": "0.05"})
    yield srv
    srv.stop()


def test_sigstopped_worker_is_frozen_failed_and_restarted(plain_server: Server) -> None:
    srv = plain_server
    [pid] = srv.worker_pids()
    results: list[list[str]] = []
    threads = [threading.Thread(target=_stream, args=(srv, _body(100_000 // 40), results)) for _ in range(2)]
    for t in threads:
        t.start()
    _wait_for(lambda: metric_sum(_metrics(srv), "vllm:num_requests_running") == 2, 30, "two streams running")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        for t in threads:
            t.join(timeout=HEARTBEAT_TIMEOUT_S + 10)
        ended = time.monotonic() - stopped
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert ended <= HEARTBEAT_TIMEOUT_S + 1.0, f"streams ended {ended:.1f}s after SIGSTOP"
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "worker_died"
    assert "frozen: no frame for" in srv.log()
    _wait_for(lambda: not alive(pid), 10, "the frozen worker killed")
    _wait_for(lambda: bool(srv.worker_pids()) and httpx.get(f"{srv.url}/ready").status_code == 200, 60,
              "a new worker serving")
    assert srv.worker_pids() != [pid]
    r = httpx.post(f"{srv.url}/v1/completions", json={**_body(4), "stream": False}, headers=srv.headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert _series(_metrics(srv), 'kvgate:workers_lost_total{model_name="tiny",kind="frozen"}') == 1


def test_worker_heard_again_after_giving_up_holds_nothing_untracked(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                       "--zmq-bind", f"tcp://127.0.0.1:{port}", workers=0, wait=False)
    worker_log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers.process.worker", "--connect", f"tcp://127.0.0.1:{port}", "--worker-id", "ext",
         "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
         "--kv-cache-tokens", "16384", "--max-num-seqs", "2"],
        cwd=REPO, stdout=worker_log, stderr=subprocess.STDOUT,
        env={**deployment_env(srv.secret), "KVGATE_DEBUG_STEP_DELAY": "0.2"})
    try:
        finish_start(srv)
        results: list[list[str]] = []
        # max-num-seqs 2: two run, four wait; all six are given up on when the worker freezes.
        threads = [threading.Thread(target=_stream, args=(srv, _body(100_000 // 40), results)) for _ in range(6)]
        for t in threads:
            t.start()
        _wait_for(lambda: metric_sum(_metrics(srv), "vllm:num_requests_waiting") == 4, 30, "2 running, 4 waiting")
        os.kill(worker.pid, signal.SIGSTOP)
        for t in threads:
            t.join(timeout=HEARTBEAT_TIMEOUT_S + 10)
        assert len(results) == 6 and all(json.loads(lines[-2][6:])["error"]["code"] == "worker_died"
                                         for lines in results)
        os.kill(worker.pid, signal.SIGCONT)  # heard from again: it still holds six requests nobody waits for
        _wait_for(lambda: "is talking again" in srv.log(), 20, "the worker taken back")

        def drained() -> bool:
            text = _metrics(srv)
            return (metric_sum(text, "kvgate:workers_ready") == 1
                    and metric_sum(text, "vllm:num_requests_running") == 0
                    and metric_sum(text, "vllm:num_requests_waiting") == 0
                    and metric_sum(text, "vllm:kv_cache_usage_perc") == 0)

        _wait_for(drained, 20, "the rejoined worker holding no request")
        # The four waiting ones produce no output: only the heartbeat's list can reveal them. The two running
        # ones may be caught first as orphans (their outputs reach a gateway that no longer tracks them).
        assert 4 <= metric_sum(_metrics(srv), "kvgate:reconciled_aborts_total") <= 6
        r = httpx.post(f"{srv.url}/v1/completions", json={**_body(3), "stream": False}, headers=srv.headers,
                       timeout=60)
        assert r.status_code == 200
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.terminate()
            worker.wait(20)
        worker_log.close()
        srv.stop()
