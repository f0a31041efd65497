"""Affinity keys beside the prefixes in the router (gateway/fleet/routing.py). LoRA adapters: a request with an
adapter and no known prefix goes to the worker that ran that adapter last (it likely holds it resident), unless that
worker is too busy or the tenant's spread rules it out; a known prefix still wins. OpenAI's prompt_cache_key: first,
within its tenant."""

from __future__ import annotations

import pytest

from gateway.config import AdmissionConfig, TimingConfig
from gateway.fleet.pool import WorkerPool
from gateway.fleet.routing import Placement, Router, TenantCounts, WorkerLoad, adapter_key, prefix_keys
from ipc.messages import PROTOCOL_VERSION, Hello
from ipc.sampling import SamplingParams


def _load(wid: str, requests: int, tenant: str = "other") -> WorkerLoad:
    counts = TenantCounts()
    for _ in range(requests):
        counts.add(tenant, 1.0, 8)
    return WorkerLoad(wid, requests, 8 * requests, 0.0, counts)


def test_an_adapter_follows_the_worker_that_ran_it() -> None:
    r = Router(AdmissionConfig(affinity_slack=4))
    r.record([adapter_key("/loras/a")], "w2")
    loads = [_load("w1", 1), _load("w2", 3)]  # w1 is the less loaded
    assert r.choose(loads, [adapter_key("/loras/a")], 8) == "w2"
    assert r.choose(loads, [adapter_key("/loras/b")], 8) == "w1"  # another adapter: the least loaded
    assert r.choose(loads, [], 8) == "w1"  # the base model: the least loaded


def test_a_busy_adapter_worker_is_passed_over() -> None:
    r = Router(AdmissionConfig(affinity_slack=4))
    r.record([adapter_key("/loras/a")], "w2")
    assert r.choose([_load("w1", 0), _load("w2", 5)], [adapter_key("/loras/a")], 8) == "w1"  # 5 more: past slack


def test_a_known_prefix_comes_before_the_adapter() -> None:
    r = Router(AdmissionConfig(affinity_slack=4))
    prompt = list(range(100))
    prefix = prefix_keys("salt\x1flora:/loras/a", prompt)
    r.record(prefix, "w1")
    r.record([adapter_key("/loras/a")], "w2")
    keys = [*prefix, adapter_key("/loras/a")]  # as the pool builds them: prefixes longest first, then the adapter
    assert r.choose([_load("w1", 2), _load("w2", 2)], keys, len(prompt)) == "w1"


def test_the_tenant_spread_still_applies() -> None:
    r = Router(AdmissionConfig(affinity_slack=8, tenant_slack=2))
    r.record([adapter_key("/loras/a")], "w2")
    loads = [_load("w1", 0, "t"), _load("w2", 3, "t")]  # one more of t's on w2: 4 to 0, past the slack
    assert r.choose(loads, [adapter_key("/loras/a")], 8, Placement("t")) == "w1"


def test_adapter_keys_differ_from_prefix_keys_and_each_other() -> None:
    a, b = adapter_key("/loras/a"), adapter_key("/loras/b")
    assert a != b and len(a) == 16
    assert a not in prefix_keys("", list(range(64))) and a not in prefix_keys("/loras/a", list(range(64)))


@pytest.mark.trio  # the pool's handles read Trio's clock
async def test_a_prompt_cache_key_draws_a_tenant_s_requests_to_where_the_last_one_went() -> None:
    """OpenAI's prompt_cache_key: short prompts (no prefix key) that share one go to the worker its last request
    went to; the same key of another tenant is another key."""
    pool = WorkerPool(None, "m", TimingConfig(), AdmissionConfig())  # type: ignore[arg-type]  # no socket used here
    for wid in ("w0", "w1"):
        pool._on_hello(wid.encode(), Hello(PROTOCOL_VERSION, wid, 4242, "m", 4096, 16, 256, 100, [0], 8, 256))
    other = await pool.submit("x", [1, 2, 3], SamplingParams(), "t1", None)  # w0: the lower id of two idle ones
    keyed = await pool.submit("a", [4, 5, 6], SamplingParams(), "t1", None, prompt_cache_key="conv-1")
    assert (other.worker_id, keyed.worker_id) == ("w0", "w1")  # the less loaded: the key is recorded there
    pool.release(other)
    pool.release(keyed)
    again = await pool.submit("b", [7, 8, 9], SamplingParams(), "t1", None, prompt_cache_key="conv-1")
    plain = await pool.submit("c", [7, 8, 9], SamplingParams(), "t2", None)
    pool.release(plain)
    stranger = await pool.submit("d", [7, 8, 9], SamplingParams(), "t2", None, prompt_cache_key="conv-1")
    assert (again.worker_id, plain.worker_id, stranger.worker_id) == ("w1", "w0", "w0")
