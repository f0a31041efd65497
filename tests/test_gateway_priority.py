"""vLLM's per-request ``priority`` through ``kvgate serve`` (tiny model): with one sequence slot, a bulk request
(priority 100) running a long answer is preempted by an interactive one (priority 0) that arrives after it, which
finishes first; under ``--scheduling-policy fcfs`` a priority other than 0 is a 400, as in vLLM."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_gateway_support import MODEL, Server, start_server

pytestmark = pytest.mark.timeout(300)


def _post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                      json={"model": MODEL, "prompt": "Once upon a time", **body})


@pytest.fixture(scope="module")
def one_slot(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("prio") / "gateway.log", "--max-num-seqs", "1",
                       env={"KVGATE_DEBUG_STEP_DELAY": "0.01"})
    yield srv
    srv.stop()


def test_an_interactive_request_overtakes_a_running_bulk_one(one_slot: Server) -> None:
    ended: dict[str, float] = {}

    def bulk() -> None:
        r = _post(one_slot, {"max_tokens": 300, "ignore_eos": True, "priority": 100})
        assert r.status_code == 200, r.text
        ended["bulk"] = time.monotonic()

    t = threading.Thread(target=bulk)
    t.start()
    time.sleep(0.5)  # the bulk request is decoding in the only slot
    r = _post(one_slot, {"max_tokens": 5, "ignore_eos": True, "priority": 0})
    ended["chat"] = time.monotonic()
    t.join(120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert ended["chat"] < ended["bulk"]  # it took the slot (the bulk one was preempted and resumed)
    metrics = httpx.get(one_slot.url + "/metrics", timeout=10).text
    assert any(line.startswith("vllm:num_preemptions_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines()), "the bulk request was preempted"


def test_fcfs_refuses_a_priority_and_bad_values_are_400(fcfs_server: Server) -> None:
    srv = fcfs_server
    assert _post(srv, {"max_tokens": 2}).status_code == 200
    r = _post(srv, {"max_tokens": 2, "priority": 5})
    assert r.status_code == 400 and "priority scheduling policy" in r.json()["error"]["message"]
    for bad in ("high", 2**40, 1.5):
        r = _post(srv, {"max_tokens": 2, "priority": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
