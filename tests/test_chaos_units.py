"""The chaos package's own pieces, without a deployment: the CLI's usage errors and listing (through ``kvgate``),
SSE event parsing, raw HTTP framing, percentiles and the verdict's JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chaos.cli import app
from chaos.drills import all_drills
from chaos.load import Outcome, percentile, tally
from chaos.rawhttp import build, complete, parse
from chaos.runner import RunOptions
from chaos.sse import error_of, parse_event
from chaos.verdict import DrillResult, check, skipped
from console.kvgate import main as kvgate_main

ISSUE_DRILLS = ["worker-kill", "worker-freeze", "slow-steps", "disconnect-storm", "overload", "slow-readers",
                "redis-outage", "store-trouble", "gateway-kill", "bad-input", "rolling-restart",
                "hostile-schemas", "stalled-streams", "worker-hijack",  # issue 24
                "batch-interactive", "batch-kills",  # issue 26
                "lora-churn"]  # issue 25


def test_every_drill_of_the_issue_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(d.name for d in all_drills()) == sorted(ISSUE_DRILLS)
    with pytest.raises(SystemExit) as done:
        kvgate_main(["chaos", "list"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ISSUE_DRILLS)


def test_usage_errors_exit_2() -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["run", "no-such-drill"]).exit_code == 2
    remote = runner.invoke(app, ["run", "overload", "--url", "http://10.1.2.3:8000", "--admin-token", "x" * 20])
    assert remote.exit_code == 2 and "loopback" in remote.output
    assert runner.invoke(app, ["run", "overload", "--url", "http://127.0.0.1:9"]).exit_code == 2  # no credentials


def test_run_options_refuse_non_loopback() -> None:
    with pytest.raises(ValueError):
        RunOptions(url="http://example.com", api_key="k")
    assert RunOptions(url="http://localhost:8000", api_key="k").url == "http://localhost:8000"


def test_sse_events() -> None:
    assert parse_event("[DONE]").done
    chunk = parse_event(json.dumps({"id": "cmpl-1", "choices": [{"text": "hi"}]}))
    assert chunk.request_id == "cmpl-1" and chunk.has_content
    role = parse_event(json.dumps({"id": "c", "choices": [{"delta": {"role": "assistant"}}]}))
    assert not role.has_content
    err = parse_event(json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": "worker_died"}}))
    assert err.error is not None and err.error["code"] == "worker_died"
    assert parse_event("{not json").malformed


def test_error_shape() -> None:
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert error_of(json.dumps(good)) is not None
    assert error_of(json.dumps({"error": {"message": "m"}})) is None
    assert error_of(b"\xff") is None and error_of("[]") is None


def test_raw_http_framing() -> None:
    request = build("POST", "/x", b"{}", [(b"Authorization", b"Bearer \xff")])
    assert request.startswith(b"POST /x HTTP/1.1\r\n") and b"Content-Length: 2\r\n" in request
    assert request.endswith(b"\r\n\r\n{}")
    whole = b"HTTP/1.1 400 \r\ncontent-length: 2\r\n\r\n{}"
    assert complete(whole) and not complete(whole[:-1])
    answer = parse(whole)
    assert answer.status == 400 and answer.body == b"{}"
    chunked = b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"
    assert complete(chunked) and parse(chunked).body == b"ab"
    assert parse(b"").status is None


def test_percentile_and_tally() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0], 99) == 3.0
    outcomes = [Outcome(0, kind="completed"), Outcome(1, kind="hung"), Outcome(2, kind="completed")]
    assert tally(outcomes) == {"completed": 2, "hung": 1}
    assert outcomes[0].clean and not outcomes[1].clean


def test_verdict_json() -> None:
    r = DrillResult("overload", "quick")
    assert not r.passed  # no check: nothing was shown
    r.add(check("a", True, "fine"), skipped("b", "not observable"))
    assert r.passed and r.to_json()["checks"][1]["status"] == "skip"
    r.add(check("c", False))
    body = r.to_json()
    assert body["passed"] is False and json.loads(json.dumps(body)) == body


def test_a_drill_that_cannot_run_here_is_skipped_not_failed() -> None:
    r = DrillResult("gateway-kill", "quick", not_run="needs its own deployment")
    assert r.passed and r.verdict == "SKIP" and r.to_json()["verdict"] == "SKIP"
    r.error = "broke"
    assert not r.passed and r.verdict == "FAIL"
