"""Drain and rolling restart of real workers over HTTP (issue 14 item 5), on the tiny model: two workers behind one
gateway, 16 clients streaming back to back while ``kvgatectl worker restart --all`` drains each worker in turn and
waits for its fresh process. Every stream completes ([DONE], usage = max_tokens with ignore_eos), the first drained
worker held streams when its drain began, and both worker pids change. No timed assertion: every wait is bounded
generously and only what happened is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio

from tests.tenancy_support import ids_prompt
from tests.test_gateway_support import ADMIN_TOKEN, MODEL, REPO, Server
# srv: the session's gateway with two workers on the tiny model, both ready (shared with the two-worker tests);
# own_srv: one of the same of its own, for the test that restarts its workers
from tests.test_gateway_two_workers import _wait_workers, _workers, own_srv, srv  # noqa: F401

pytestmark = pytest.mark.timeout(900)

CLIENTS = 16
MAX_TOKENS = 40  # client i asks for MAX_TOKENS + 3 * i: streams of different lengths do not end in lockstep


@dataclass
class Stream:
    max_tokens: int
    status: int = 0
    done: bool = False  # saw data: [DONE]
    completion_tokens: int | None = None
    error: Any = None


async def _stream(client: httpx.AsyncClient, srv: Server, seed: int, max_tokens: int) -> Stream:
    body = {"model": MODEL, "prompt": ids_prompt(12, seed), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = Stream(max_tokens)
    async with client.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers) as r:
        out.status = r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
        if r.status_code != 200:
            out.error = (await r.aread()).decode(errors="replace")
    return out


async def _roll_under_load(srv: Server) -> tuple[list[Stream], subprocess.CompletedProcess[bytes]]:
    """16 clients stream back to back from before the roll starts until it has ended."""
    streams: list[Stream] = []
    running = trio.Event()
    rolled = trio.Event()
    cmd = [sys.executable, "-m", "console.kvgatectl", "--url", srv.url, "--admin-token", ADMIN_TOKEN,
           "worker", "restart", "--all", "--timeout", "600", "--json"]

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while not rolled.is_set():
            n += 1
            streams.append(await _stream(client, srv, 10_000 * i + n, MAX_TOKENS + 3 * i))
            if len(streams) >= CLIENTS:
                running.set()

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    with trio.fail_after(800):
        async with httpx.AsyncClient(timeout=300, limits=limits) as client, trio.open_nursery() as nursery:
            for i in range(CLIENTS):
                nursery.start_soon(client_loop, i, client)
            await running.wait()  # every client has completed a stream: the load is on
            roll = await trio.run_process(cmd, cwd=REPO, capture_stdout=True, capture_stderr=True, check=False)
            rolled.set()
    return streams, roll


def test_admin_api_lists_states_and_refuses_bad_drains(srv: Server) -> None:
    rows = _workers(srv)
    assert sorted(r["worker"] for r in rows) == ["w0", "w1"] and {r["state"] for r in rows} == {"ready"}
    url = f"{srv.url}/admin/workers"
    r = httpx.post(f"{url}/w9/drain", headers=srv.admin_headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found", r.text
    r = httpx.post(f"{url}/w0/drain", json={"timeout": -1}, headers=srv.admin_headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
    r = httpx.post(f"{url}/w0/drain", headers=srv.headers, timeout=10)  # a tenant key is not the admin token
    assert r.status_code == 401, r.text
    assert {r["state"] for r in _workers(srv)} == {"ready"}  # nothing was drained by the refused calls


def test_rolling_restart_under_16_streams_fails_none(own_srv: Server) -> None:
    srv = own_srv
    before = {r["worker"]: r["hello"]["pid"] for r in _workers(srv)}
    streams, roll = trio.run(_roll_under_load, srv)
    assert roll.returncode == 0, roll.stderr.decode(errors="replace")
    result = json.loads(roll.stdout)["data"]
    assert [r["worker"] for r in result] == ["w0", "w1"]
    # The first drain had streams to finish (16 clients run over both workers). The second usually has too, but
    # whether all of them ended just as the first worker came back is timing: not asserted.
    assert result[0]["in_flight_at_drain"] > 0, result
    bad = [s for s in streams if not (s.status == 200 and s.done and s.completion_tokens == s.max_tokens
                                      and s.error is None)]
    assert not bad and len(streams) > CLIENTS, (len(streams), bad[:5])
    after = {r["worker"]: r["hello"]["pid"] for r in _wait_workers(srv, 2)}
    assert set(after) == {"w0", "w1"} and all(after[w] != before[w] for w in before), (before, after)
    assert {r["worker"]: r["new_pid"] for r in result} == after
    log = srv.log()
    assert "drained and exited" in log and "restarting in" not in log  # a drain is no crash: no backoff
