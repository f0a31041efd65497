"""Drain on SIGTERM (issue 14 item 5), over real HTTP: the gateway stops admitting (503 with retry-after on the
API, /ready false), lets the stream in flight finish whole, then exits 0; a stream longer than --drain-timeout is
cut when the timeout ends (its client gets an error event, code gateway_shutdown) and the gateway exits
anyway."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.tenancy_support import ids_prompt
from tests.test_gateway_support import MODEL, start_server

pytestmark = pytest.mark.timeout(240)

COMP = "/v1/completions"


def _stream_body(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": ids_prompt(10, 3), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _chunks(lines: object) -> tuple[list[dict[str, object]], bool]:
    """The stream's JSON events and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:  # type: ignore[attr-defined]
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events, done


@pytest.mark.parametrize("drain_timeout", ["120"])
def test_sigterm_drains_the_stream_in_flight_then_exits(tiny_model_dir: Path, tmp_path: Path,
                                                         drain_timeout: str) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--drain-timeout", drain_timeout)
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{srv.url}{COMP}", json=_stream_body(3000), headers=headers) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")  # admitted and generating
                srv.proc.send_signal(signal.SIGTERM)
                refused = client.post(f"{srv.url}{COMP}", json={**_stream_body(2), "stream": False,
                                                                 "stream_options": None}, headers=headers)
                ready = client.get(f"{srv.url}/ready")
                events, done = _chunks(lines)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
        assert float(refused.headers["retry-after"]) >= 1
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
        # The stream in flight finished whole: every token, its finish reason and [DONE].
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]  # type: ignore
        assert done and finish == ["length"] and events[-1]["usage"]["completion_tokens"] == 3000  # type: ignore
        assert srv.proc.wait(timeout=60) == 0
        assert '"event": "drain_done", "in_flight": 0' in srv.log() or '"in_flight":0' in srv.log()
    finally:
        srv.stop()


def test_drain_timeout_cuts_a_longer_stream_and_exits(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--drain-timeout", "0")
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{srv.url}{COMP}", json=_stream_body(3000), headers=headers) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                srv.proc.send_signal(signal.SIGTERM)
                events, done = _chunks(lines)
        # Cut, and told so: the last event is an error the client can act on, not a silent end of the stream.
        err = events[-1].get("error")
        assert isinstance(err, dict) and err["code"] == "gateway_shutdown", events[-3:]
        assert srv.proc.wait(timeout=60) == 0
        assert "drain timeout" in srv.log()
    finally:
        srv.stop()
