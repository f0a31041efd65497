"""Tenant tiers through ``kvgate serve`` (tiny model, one sequence slot, two requests of admission per worker):
tiers set with kvgatectl against the admin API; a batch-tier tenant holding the worker's batch share is refused a
second request (429 ``tier_capacity_exceeded`` with a retry-after) while an interactive tenant still gets in, and
its request, arriving after the batch one, takes the only slot and finishes first (the tier's priority); the
per-tier series on /metrics count all of it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from console.kvgatectl import app as kvgatectl
from tests.test_gateway_support import (ADMIN_TOKEN, MODEL, Server, metric_sum, start_server,  # noqa: F401
                                        tiny_model_dir)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiered(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("tiers") / "gateway.log", "--max-num-seqs", "1",
                       "--max-queued-requests", "2", env={"KVGATE_DEBUG_STEP_DELAY": "0.01"})
    yield srv
    srv.stop()


def _ctl(server: Server, *args: str) -> Any:
    result = CliRunner().invoke(kvgatectl, ["--url", server.url, "--admin-token", ADMIN_TOKEN, "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _tenant_key(server: Server, name: str, tier: str) -> str:
    created = _ctl(server, "tenant", "create", name, "--tier", tier)
    assert created["tier"] == tier
    return str(_ctl(server, "key", "create", name)["key"])


def _post(server: Server, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "prompt": "Once upon a time", **body})


def _running(server: Server) -> float:
    return metric_sum(httpx.get(server.url + "/metrics", timeout=10).text, "vllm:num_requests_running")


def _settled_counts(server: Server) -> tuple[float, float]:
    """The worker's (prompt, generation) token counters once it is idle and two heartbeats (0.5 s apart) in a row
    show the same: the gauges on /metrics are the last heartbeat's, so a reply can reach the client before the
    heartbeat that shows its request gone."""
    deadline, last = time.monotonic() + 60, (-1.0, -1.0)
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        now = (metric_sum(text, "vllm:prompt_tokens_total"), metric_sum(text, "vllm:generation_tokens_total"))
        idle = metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting") == 0
        if idle and now == last:
            return now
        assert time.monotonic() < deadline, text
        last = now if idle else (-1.0, -1.0)
        time.sleep(1.1)


def test_tiers_order_admission_and_the_engine(tiered: Server) -> None:
    bulk_key = _tenant_key(tiered, "bulk", "batch")
    fast_key = _tenant_key(tiered, "fast", "standard")
    assert _ctl(tiered, "tenant", "set-tier", "fast", "interactive")["tier"] == "interactive"
    ended: dict[str, float] = {}

    def bulk() -> None:
        r = _post(tiered, bulk_key, {"max_tokens": 300, "ignore_eos": True})
        assert r.status_code == 200, r.text
        ended["bulk"] = time.monotonic()

    t = threading.Thread(target=bulk)
    t.start()
    deadline = time.monotonic() + 30
    while _running(tiered) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = _post(tiered, bulk_key, {"max_tokens": 5})  # 1 in flight = half of the 2 the worker takes
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "tier_capacity_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    r = _post(tiered, fast_key, {"max_tokens": 5, "ignore_eos": True})
    ended["fast"] = time.monotonic()
    t.join(120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert ended["fast"] < ended["bulk"]  # the interactive tier's priority took the only slot
    text = httpx.get(tiered.url + "/metrics", timeout=10).text
    assert metric_sum(text, 'kvgate:tier_refusals_total{reason="tier_capacity_exceeded",tier="batch"}') == 1
    assert metric_sum(text, 'kvgate:tier_requests_total{status="length",tier="interactive"}') == 1
    assert metric_sum(text, 'kvgate:tier_requests_total{status="length",tier="batch"}') == 1
    assert metric_sum(text, 'kvgate:tier_time_to_first_token_seconds_count{tier="interactive"}') == 1
    assert metric_sum(text, 'kvgate:tier_queue_time_seconds_count{tier="batch"}') == 1
    assert metric_sum(text, 'kvgate:tier_preemptions_total{tier="batch"}') >= 1  # preempted for the interactive one
    assert metric_sum(text, 'kvgate:tier_preemptions_total{tier="interactive"}') == 0


def test_openai_service_tier_lowers_a_request_and_says_where_it_ran(tiered: Server) -> None:
    key = _tenant_key(tiered, "svc", "standard")
    plain = _post(tiered, key, {"max_tokens": 2})
    assert plain.status_code == 200 and "service_tier" not in plain.json()  # not asked: not told (as OpenAI)
    before = metric_sum(httpx.get(tiered.url + "/metrics", timeout=10).text,
                        'kvgate:tier_requests_total{status="length",tier="batch"}')
    told = {asked: _post(tiered, key, {"max_tokens": 2, "service_tier": asked, "ignore_eos": True}).json()
            for asked in ("auto", "default", "flex", "priority")}
    assert {asked: body["service_tier"] for asked, body in told.items()} == {
        "auto": "default", "default": "default", "flex": "flex", "priority": "default"}  # never above its tier
    after = metric_sum(httpx.get(tiered.url + "/metrics", timeout=10).text,
                       'kvgate:tier_requests_total{status="length",tier="batch"}')
    assert after - before == 1  # the flex one ran in the batch class
    bad = _post(tiered, key, {"max_tokens": 2, "service_tier": "turbo"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "service_tier"
    for asked, shown in ((None, "default"), ("flex", "flex")):
        r = httpx.post(tiered.url + "/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False,
                             **({} if asked is None else {"service_tier": asked})})
        assert r.status_code == 200 and r.json()["service_tier"] == shown, r.text


def test_a_request_the_workers_could_never_hold_is_a_400_not_a_503(tiered: Server) -> None:
    """The worker admits 2 requests: 3 prompts (3 sequences) can never be held at once, whatever the load, so the
    client is told to split them (a 503 would be retried forever; a Batch API line would retry until it expires);
    a batch-tier tenant may fill half the bounds: 2 prompts already are too many for it."""
    standard, bulk = _tenant_key(tiered, "split-std", "standard"), _tenant_key(tiered, "split-bulk", "batch")
    before = _settled_counts(tiered)
    refused = _post(tiered, standard, {"prompt": ["a", "b", "c"], "max_tokens": 2})
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["code"] == "exceeds_worker_capacity" and "3 sequences" in err["message"] and "admit 2" in err["message"]
    held = _post(tiered, standard, {"prompt": ["a", "b"], "max_tokens": 2})
    assert held.status_code == 200, held.text
    assert _post(tiered, standard, {"prompt": "a", "n": 3, "max_tokens": 2}).status_code == 400  # n counts too
    low = _post(tiered, bulk, {"prompt": ["a", "b"], "max_tokens": 2})
    assert low.status_code == 400 and "admit 1" in low.json()["error"]["message"], low.text
    prompt, generated = _settled_counts(tiered)
    usage = held.json()["usage"]
    # nothing was queued for any of the refused ones: the worker computed the held request's tokens and no more
    assert (prompt - before[0], generated - before[1]) == (usage["prompt_tokens"], usage["completion_tokens"])
