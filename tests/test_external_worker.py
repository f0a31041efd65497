"""Workers started by hand (issue 24 item 5), under a real ``kvgate serve``:

- hung: an external worker whose step runs past ``--step-timeout`` is given up on once for that step. Its I/O
  thread keeps heartbeating, and the pool used to take it back at the next heartbeat and give up on it again at
  the next monitor tick (a flap a quarter second long, over and over), routing requests to it in between; now it
  is taken back only once a heartbeat shows that step done;
- a gateway restart: a hand-started worker outlives the gateway being gone longer than the worker's 5 s
  "gateway gone" bound (that bound is for the workers a gateway starts, which also watch their parent) and
  re-introduces itself to the next gateway on the same address, which serves with it.

Timings here are liveness promises of the product (step and heartbeat timeouts), never throughput.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chaos.procs import stop_process
from tests.test_gateway_support import (MAX_MODEL_LEN, MODEL, REPO, Server, deployment_env, finish_start,
                                        free_port, metric_sum, start_server, tiny_model_dir)  # noqa: F401
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(400)

STEP_TIMEOUT_S = 1.5
STEP_DELAY_S = 4.0  # every step with work spins this long, holding the GIL (the worker's drill hook)


def _worker(port: int, model_dir: Path, log: Path, secret: str, step_delay: float = 0.0) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "workers.process.worker", "--connect", f"tcp://127.0.0.1:{port}",
             "--worker-id", "ext", "--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len",
             str(MAX_MODEL_LEN), "--kv-cache-tokens", "16384", "--log-format", "text"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**deployment_env(secret), "KVGATE_DEBUG_STEP_DELAY": str(step_delay)})


def _complete(srv: Server, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": list(range(1, 21)), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=120)


def _lost(srv: Server, kind: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("kvgate:workers_lost_total{") and f'kind="{kind}"' in ln)


def test_a_hung_external_worker_is_given_up_once_and_taken_back_after_its_step(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    port = free_port()
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--step-timeout", str(STEP_TIMEOUT_S),
                       "--heartbeat-timeout", "3", "--zmq-bind", f"tcp://127.0.0.1:{port}", workers=0, wait=False)
    worker = _worker(port, tiny_model_dir, tmp_path / "worker.log", srv.secret, STEP_DELAY_S)
    try:
        finish_start(srv)
        started = time.monotonic()
        r = _complete(srv, max_tokens=1)  # one step (prefill), 4 s long: hung at 1.5 s
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died", r.text
        # While that step still runs, the worker is out: a request is refused at once, never routed to it.
        if time.monotonic() - started < STEP_DELAY_S - 1.0:
            refused = _complete(srv, max_tokens=1)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker", refused.text
        wait_until(lambda: "is talking again" in srv.log(), within=30, what="the worker taken back after its step")
        time.sleep(1.0)  # a flapping pool would have given up on it again by now
        assert _lost(srv, "hung") == 1, srv.log()[-4000:]
        assert metric_sum(httpx.get(f"{srv.url}/metrics", timeout=10).text, "kvgate:workers_ready") == 1
    finally:
        stop_process(worker)
        srv.stop()


def test_a_hand_started_worker_outlives_a_gateway_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ("--zmq-bind", f"tcp://127.0.0.1:{port}")
    first = start_server(tiny_model_dir, tmp_path / "gateway1.log", *args, workers=0, wait=False)
    worker = _worker(port, tiny_model_dir, tmp_path / "worker.log", first.secret)
    second: Server | None = None
    try:
        finish_start(first)
        assert _complete(first, max_tokens=2).status_code == 200
        first.stop()
        time.sleep(8.0)  # gone longer than the 5 s "gateway gone" bound of the workers a gateway starts
        worker_log = (tmp_path / "worker.log").read_text(errors="replace")
        assert worker.poll() is None and "exiting" not in worker_log, worker_log[-3000:]
        second = start_server(tiny_model_dir, tmp_path / "gateway2.log", *args, workers=0,
                              db_path=first.db_path, secret=first.secret)
        second.api_key = first.api_key  # the store's demo tenant: printed once, at the first start
        r = _complete(second, max_tokens=3)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        stop_process(worker)
        if second is not None:
            second.stop()
