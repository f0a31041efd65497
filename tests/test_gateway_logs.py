"""Logs over real HTTP: JSON lines with one line per finished (or refused) request, carrying ids, counts and
timings, and never the prompt or the completion: a canary string sent every way a request can carry text
(prompt, chat message, stop string, a rejected request, a stream cut off mid-way) appears in no log line."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_gateway_support import MODEL, Server, start_server, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.timeout(180)

CANARY = "zebra-canary-7f3a9c"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs") / "gateway.log")
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
    for _ in range(50):
        lines = _gateway_json_lines(srv)
        if sum(rec.get("event") == "request_finished" for rec in lines) >= 3:
            break
        time.sleep(0.1)
    assert CANARY not in srv.log()
    finished = [rec for rec in lines if rec.get("event") == "request_finished"]
    assert sorted(str(rec["status"]) for rec in finished) == ["cancelled", "length", "length"]
    assert {rec["request_id"] for rec in finished} >= {ok.json()["id"]}
    for rec in finished:
        assert rec["tenant_id"] and rec["key_id"] and rec["model"] == MODEL and rec["level"] == "info"
        assert int(str(rec["prompt_tokens"])) > 0 and float(str(rec["latency_ms"])) > 0
    refused = [rec for rec in lines if rec.get("event") == "request_refused"]
    assert [rec["http_status"] for rec in refused] == [400]
