"""The per-tenant opt-in to prompt/completion text in the logs, over real HTTP: a tenant switched on with
``kvgatectl tenant set-log-text NAME on`` gets its prompt and completion in its ``request_finished`` lines (a
completion, and a streamed chat whose prompt is the rendered messages); a tenant left off (the default) has its
canary string in no log line at all, and neither does a request refused before admission, whoever sent it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.tenancy_support import kvgatectl, make_tenant
from tests.test_gateway_support import MODEL, Server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

ON_CANARY = "ocelot-canary-4d1e"  # tenant "texty" (on), completion
ON_CHAT_CANARY = "heron-canary-8b2f"  # tenant "texty" (on), chat message
ON_REFUSED_CANARY = "marmot-canary-0c7a"  # tenant "texty" (on), refused before admission: never logged
OFF_CANARY = "lynx-canary-93ea"  # tenant "quiet" (off): never logged, whatever the request


@pytest.fixture(scope="module")
def srv(server: Server) -> Server:
    """The session's default server: the tenants here are this module's own, and every assertion about the log
    looks for this module's request ids and canary strings, which no other test sends."""
    return server


def _finished_lines(srv: Server) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in srv.log().splitlines() if line.startswith("{"))
    return [rec for rec in lines if rec.get("event") == "request_finished"]


def _wait_finished(srv: Server, request_ids: set[str], within: float = 2.0) -> dict[str, dict[str, Any]]:
    """The request_finished line of each id, waiting up to `within` seconds for the last of them to land."""
    return wait_until(lambda: {str(rec["request_id"]): rec for rec in _finished_lines(srv)},
                      lambda by_id: request_ids <= set(by_id), within=within, what=f"request_finished of {request_ids}")


def _completion(srv: Server, key: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0})


def _streamed_chat(srv: Server, key: str, content: str) -> tuple[str, str]:
    """(request id, completion text) of a streamed chat completion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "ignore_eos": True, "temperature": 0, "stream": True}
    request_id, text = "", ""
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            request_id = chunk["id"]
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
    return request_id, text


def test_only_the_opted_in_tenant_gets_its_text_logged(srv: Server) -> None:
    on_id, on_key = make_tenant(srv, "texty")
    off_id, off_key = make_tenant(srv, "quiet")
    switched = kvgatectl(srv, "--json", "tenant", "set-log-text", "texty", "on")
    assert switched.returncode == 0, switched.stderr
    assert json.loads(switched.stdout)["log_text"] is True

    on = _completion(srv, on_key, f"say {ON_CANARY} please")
    off = _completion(srv, off_key, f"say {OFF_CANARY} please")
    assert on.status_code == off.status_code == 200
    chat_id, chat_text = _streamed_chat(srv, on_key, f"repeat {ON_CHAT_CANARY}")
    off_chat_id, _ = _streamed_chat(srv, off_key, f"repeat {OFF_CANARY}")
    for key, canary in ((on_key, ON_REFUSED_CANARY), (off_key, OFF_CANARY)):
        refused = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                             json={"model": MODEL, "prompt": canary, "max_tokens": -1})
        assert refused.status_code == 400

    ids = {on.json()["id"], off.json()["id"], chat_id, off_chat_id}
    lines = _wait_finished(srv, ids)
    assert ids <= set(lines), "every request's request_finished line lands within 2 s"

    logged = lines[on.json()["id"]]
    assert logged["tenant_id"] == on_id and ON_CANARY in logged["prompt"]
    assert logged["completion"] and logged["completion"] == on.json()["choices"][0]["text"]
    chat = lines[chat_id]
    assert chat["tenant_id"] == on_id and ON_CHAT_CANARY in chat["prompt"]  # the rendered chat template
    assert chat["completion"] == chat_text

    for request_id in (off.json()["id"], off_chat_id):
        assert lines[request_id]["tenant_id"] == off_id
        assert "prompt" not in lines[request_id] and "completion" not in lines[request_id]
    log = srv.log()
    assert OFF_CANARY not in log and ON_REFUSED_CANARY not in log
    # The opted-in canaries appear in their own request_finished lines and nowhere else (not the access lines).
    holders = [json.loads(line) for line in log.splitlines() if ON_CANARY in line or ON_CHAT_CANARY in line]
    assert [(rec["event"], rec["request_id"]) for rec in holders] == [
        ("request_finished", on.json()["id"]), ("request_finished", chat_id)]


def _logs_prompt(srv: Server, key: str) -> bool:
    probe = _completion(srv, key, "probe")
    assert probe.status_code == 200
    request_id = probe.json()["id"]
    return "prompt" in _wait_finished(srv, {request_id})[request_id]


def test_switching_off_stops_the_text_within_the_auth_cache_ttl(srv: Server) -> None:
    _, key = make_tenant(srv, "flip")
    assert kvgatectl(srv, "tenant", "set-log-text", "flip", "on").returncode == 0
    first = _completion(srv, key, "warm the auth cache")
    assert first.status_code == 200
    assert kvgatectl(srv, "tenant", "set-log-text", "flip", "off").returncode == 0
    # The gateway caches the principal for 1 s (kvgatectl --db cannot drop it): probe until a request stops
    # carrying its prompt, then send the canary.
    wait_until(lambda: _logs_prompt(srv, key), lambda logged: not logged, within=4.0, what="log text switched off",
               interval=0.1)
    canary = "dormouse-canary-51b7"
    second = _completion(srv, key, f"say {canary}")
    assert second.status_code == 200
    lines = _wait_finished(srv, {first.json()["id"], second.json()["id"]})
    assert "prompt" in lines[first.json()["id"]]
    assert "prompt" not in lines[second.json()["id"]] and canary not in srv.log()
