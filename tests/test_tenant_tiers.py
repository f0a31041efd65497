"""Tenant tiers (issue 26 item 2): the tier table and its priority rule, the store's tier column (migration 6 on
SQLite and PostgreSQL: existing tenants become standard), per-tier admission in the router and the pool (lower
tiers refused with a 429 of their own before they fill the headroom of higher ones), the tier metrics, and the
tier set through the admin API and kvgatectl (local and remote)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.base.errors import APIError
from gateway.config import AdmissionConfig, TimingConfig
from gateway.fleet.pool import WorkerPool
from gateway.fleet.routing import Placement, Router, TenantCounts, WorkerLoad
from gateway.pipeline.tiering import line_submission, route_submission
from gateway.telemetry.gateway_metrics import GatewayMetrics
from ipc.messages import PROTOCOL_VERSION, EngineTimings, Hello
from ipc.sampling import SamplingParams
from tenancy import schema
from tenancy.models import UsageRow
from tenancy.store import TenancyStore
from tenancy.tiers import (MAX_PRIORITY, TIER_NAMES, TIERS, engine_priority, openai_service_tier, requested_tier,
                           tier)
from tests.postgres_support import database_at_version
from tests.test_gateway_admin import assert_error, call, make_admin_app
from tests.test_kvgatectl import T0, Cli, clean_env, db, local, remote  # noqa: F401  (fixtures)

PEPPER = b"test-pepper"


# --- the table and the priority rule ----------------------------------------------------------------------

def test_tiers_are_ordered_best_first_and_standard_is_what_came_before() -> None:
    assert TIER_NAMES == ("interactive", "standard", "batch")
    priorities = [t.priority for t in TIERS]
    shares = [t.capacity_share for t in TIERS]
    assert priorities == sorted(priorities) and shares == sorted(shares, reverse=True)
    assert (tier("standard").priority, tier("standard").capacity_share) == (0, 1.0)
    assert tier("interactive").priority < 0  # the workers never age a request past 0: interactive stays first
    with pytest.raises(ValueError, match="unknown tier 'gold'; known: interactive, standard, batch"):
        tier("gold")
    # The schema's CHECK names the same tiers as the table.
    assert all(f"'{name}'" in dict(schema.MIGRATIONS)[6][0] for name in TIER_NAMES)


def test_a_request_counts_from_its_tier_and_never_jumps_above_it() -> None:
    assert [engine_priority(t, 0) for t in TIER_NAMES] == [-100, 0, 100]
    assert engine_priority("standard", 7) == 7  # as before tiers for a standard tenant
    assert engine_priority("interactive", 7) == -93  # lower within its tier
    assert engine_priority("interactive", 500) == 400  # ...or below it: only its own requests lose
    assert engine_priority("standard", -50) == 0 and engine_priority("batch", -1000) == 100  # never above
    assert engine_priority("batch", MAX_PRIORITY) == MAX_PRIORITY  # the wire's bound holds
    assert engine_priority("interactive", 0, floor=100) == 100


def test_routes_use_the_tenant_tier_and_batch_lines_the_batch_tier() -> None:
    r = route_submission("interactive", 3, None)  # None: the default policy, priority
    assert (r.tier, r.priority) == ("interactive", -97)
    assert route_submission("interactive", 3, "fcfs").priority == 3  # fcfs workers get the client's own value
    for tenant_tier in TIER_NAMES:
        line = line_submission(tenant_tier, 100, 100)  # line.prepared_body already lifted it to 100
        assert line.tier == "batch" and line.priority >= 100  # no tier's lines run above the batch class
    assert line_submission("standard", 150, 100).priority == 150  # a standard tenant's lines: as before tiers
    assert line_submission("batch", 100, 100).priority == 200
    assert line_submission("interactive", 0, None).priority == 0  # fcfs: as written


def test_service_tier_may_lower_a_request_never_lift_it() -> None:
    want = {("standard", "flex"): "batch", ("standard", "priority"): "standard", ("standard", "default"): "standard",
            ("interactive", "default"): "standard", ("interactive", "flex"): "batch",
            ("interactive", "priority"): "interactive", ("batch", "priority"): "batch", ("batch", "default"): "batch"}
    for tenant_tier in TIER_NAMES:
        assert requested_tier(tenant_tier, None) == requested_tier(tenant_tier, "auto") == tenant_tier
    for (tenant_tier, asked), runs_as in want.items():
        assert requested_tier(tenant_tier, asked) == runs_as, (tenant_tier, asked)
    r = route_submission("standard", 0, None, "flex")
    assert (r.tier, r.priority) == ("batch", 100)  # the batch class: admitted last, runs in the gaps
    assert [openai_service_tier(t) for t in TIER_NAMES] == ["priority", "default", "flex"]


# --- the store: migration 6 on both backends ----------------------------------------------------------------

def _schema_5_with_a_tenant(where: str) -> None:
    """A database as kvgate left it before tiers (migrations 1-5), holding one tenant."""
    database_at_version(where, 5, [
        "INSERT INTO tenants (id, name, status, weight, created_at) VALUES ('ten_0', 'old', 'active', 2.0, 0)"])


def test_migration_6_puts_existing_tenants_on_standard(any_db: str) -> None:
    _schema_5_with_a_tenant(any_db)
    with TenancyStore(any_db, PEPPER) as s:
        assert s.applied_migrations[:1] == [6] and s.schema_version == schema.LATEST_VERSION
        old = s.get_tenant("old")
        assert (old.id, old.weight, old.tier) == ("ten_0", 2.0, "standard")
        assert s.set_tier("old", "batch").tier == "batch"
        assert s.create_tenant("new", tier="interactive").tier == "interactive"
        assert s.create_tenant("plain").tier == "standard"
        with pytest.raises(ValueError, match="unknown tier"):
            s.set_tier("old", "gold")
        with pytest.raises(KeyError):
            s.set_tier("nobody", "batch")
        assert s.get_tenant("old").tier == "batch"  # the refused change left it alone


def test_the_tier_reaches_authentication(any_db: str) -> None:
    with TenancyStore(any_db, PEPPER) as s:
        s.create_tenant("acme", tier="interactive")
        _, key = s.create_key("acme", "k")
        auth = s.authenticate(key)
        assert auth is not None and auth.tier == "interactive"
        s.set_tier("acme", "batch")
        auth = s.authenticate(key)
        assert auth is not None and auth.tier == "batch"


# --- admission: the router and the pool -----------------------------------------------------------------------

def _load(held: int, tenant: str = "x", weight: float = 1.0) -> WorkerLoad:
    counts = TenantCounts()
    for _ in range(held):
        counts.add(tenant, weight, 8)
    return WorkerLoad("a", held, 8 * held, 0.0, counts)


def test_router_admits_each_tier_up_to_its_share_of_the_bounds() -> None:
    r = Router(AdmissionConfig(max_requests=8, max_prompt_tokens=10_000))
    share: dict[str, float] = {t.name: t.capacity_share for t in TIERS}

    def admitted(held: int, name: str, tenant: str = "x") -> bool:
        """One more request of ``tenant`` where ``held`` of tenant x's are in flight (x alone: no share rule)."""
        return r.can_admit(_load(held), 8, Placement(tenant, 1.0, share=share[name]))

    assert [admitted(3, t) for t in TIER_NAMES] == [True, True, True]
    assert [admitted(4, t) for t in TIER_NAMES] == [True, True, False]  # batch: half the bounds
    assert [admitted(8, t) for t in TIER_NAMES] == [True, False, False]  # standard: the bounds
    assert admitted(9, "interactive") and not admitted(10, "interactive")  # interactive: 1.25 x the bounds
    assert r.can_admit(_load(0), 50_000, Placement("x", share=share["batch"]))  # an idle worker takes any prompt
    # A tenant under its weighted share of a worker gets in past its tier's bounds, up to twice them (as before
    # tiers), and a lower tier still stops first.
    assert admitted(4, "batch", "new") and not admitted(8, "batch", "new") and admitted(8, "standard", "new")
    # Refused by its tier's share while the bounds as configured have room (a 429), or at them (a 503, as ever).
    assert r.reserved([_load(4)], 8, Placement("x", share=share["batch"]))
    assert not r.reserved([_load(8)], 8, Placement("x", share=share["batch"]))
    assert not r.reserved([_load(8)], 8, Placement("x", share=share["standard"]))
    assert r.over_share(_load(6), share["batch"]) == 3  # 6 -> 3 in flight: below the 4 of batch's bounds


def _pool(max_requests: int, metrics: GatewayMetrics | None = None) -> WorkerPool:
    sock: Any = None  # never touched: nothing is sent, the outbox is a memory channel
    pool = WorkerPool(sock, "m", TimingConfig(), AdmissionConfig(max_requests=max_requests), observer=metrics)
    pool._on_hello(b"w0", Hello(PROTOCOL_VERSION, "w0", 100, "m", 4096, 16, 256, 100, [0], 8, 256))
    tx, _rx = trio.open_memory_channel[Any](1000)
    pool.workers["w0"].outbox = tx
    return pool


@pytest.mark.trio
async def test_pool_refuses_lower_tiers_first_with_a_429_of_their_own() -> None:
    """Batch is refused with a 429 below the bounds; at the bounds standard gets the 503 it always got, and only
    interactive still gets in."""
    metrics = GatewayMetrics("m")
    pool = _pool(4, metrics)

    async def submit(rid: str, name: str) -> Any:
        return await pool.submit(rid, [1, 2, 3], SamplingParams(), "salt", None, tier=name)

    await submit("b0", "batch")
    await submit("b1", "batch")
    with pytest.raises(APIError) as batch_refused:
        await submit("b2", "batch")  # 2 = half of 4 in flight: the rest is for the tiers above
    e = batch_refused.value
    assert (e.status, e.code, e.err_type) == (429, "tier_capacity_exceeded", "rate_limit_error")
    assert "batch tier" in e.message and int(e.headers()["retry-after"]) >= 1
    await submit("s0", "standard")
    await submit("s1", "standard")
    with pytest.raises(APIError) as standard_refused:
        await submit("s2", "standard")  # 4 = the bounds as configured: the 503 it was before tiers
    assert (standard_refused.value.status, standard_refused.value.code) == (503, "no_capacity")
    await submit("i0", "interactive")  # 4 < 1.25 x 4: interactive's headroom past the bounds
    with pytest.raises(APIError) as full:
        await submit("i1", "interactive")
    assert (full.value.status, full.value.code) == (503, "no_capacity")
    text = metrics.render()
    assert 'kvgate:tier_refusals_total{reason="tier_capacity_exceeded",tier="batch"} 1.0' in text
    assert 'kvgate:tier_refusals_total{reason="no_capacity",tier="standard"} 1.0' in text
    assert 'kvgate:tier_refusals_total{reason="no_capacity",tier="interactive"} 1.0' in text


@pytest.mark.trio
async def test_a_lower_tier_is_told_to_wait_longer() -> None:
    pool = _pool(8)
    for i in range(8):
        await pool.submit(f"r{i}", [1], SamplingParams(), "salt", None, tier="standard")
    pool.workers["w0"].service_time = 8.0  # one request ends a second, on average
    waits = {}
    for name in ("standard", "batch"):
        with pytest.raises(APIError) as refused:
            await pool.submit("late", [1], SamplingParams(), "salt", None, tier=name)
        assert refused.value.status == 503  # the bounds as configured are full: no tier below them gets in
        waits[name] = refused.value.retry_after
    assert waits == {"standard": 1.0, "batch": 5.0}  # 1 request to end for standard, 5 for batch (8 -> 3)


# --- metrics ------------------------------------------------------------------------------------------------

def test_tier_metrics_are_exported_per_tier() -> None:
    m = GatewayMetrics("m")
    text = m.render()
    for name in TIER_NAMES:  # every tier's series exists from the start, at zero
        assert f'kvgate:tier_preemptions_total{{tier="{name}"}} 0.0' in text
        assert f'kvgate:tier_time_to_first_token_seconds_count{{tier="{name}"}} 0.0' in text
    row = UsageRow("r", "t", "k", "m", 10, 0, 5, "stop", T0, T0 + 1, ttft_ms=40.0, latency_ms=900.0)
    m.tier_finished("interactive", row, [EngineTimings(0.02, 0.04, 0.9, [0.1, 0.3]), None,
                                         EngineTimings(0.5, 0.6, 0.9, [0.2])])
    text = m.render()
    assert 'kvgate:tier_requests_total{status="stop",tier="interactive"} 1.0' in text
    assert 'kvgate:tier_preemptions_total{tier="interactive"} 3.0' in text  # every sequence's
    assert 'kvgate:tier_queue_time_seconds_sum{tier="interactive"} 0.02' in text  # the first sequence's
    assert 'kvgate:tier_time_to_first_token_seconds_sum{tier="interactive"} 0.04' in text
    assert 'kvgate:tier_time_to_first_token_seconds_count{tier="batch"} 0.0' in text


# --- the admin API and kvgatectl ----------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenancyStore]:
    s = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    yield s
    s.close()


@pytest.mark.trio
async def test_admin_api_sets_and_shows_the_tier(store: TenancyStore) -> None:
    changes: list[int] = []
    app = make_admin_app(store, "admin-secret-token", lambda: changes.append(1))
    status, t = await call(app, "POST", "/admin/tenants", {"name": "acme", "tier": "interactive"})
    assert status == 201 and t["tier"] == "interactive"
    status, t = await call(app, "PATCH", "/admin/tenants/acme", {"tier": "batch"})
    assert status == 200 and t["tier"] == "batch" and store.get_tenant("acme").tier == "batch"
    _, shown = await call(app, "GET", "/admin/tenants/acme")
    assert shown["tier"] == "batch"
    status, tiers = await call(app, "GET", "/admin/tiers")
    assert status == 200 and [t["name"] for t in tiers["data"]] == list(TIER_NAMES)
    assert len(changes) == 2  # each mutation drops the gateway's auth cache: the tier applies at once
    for body in ({"tier": "gold"}, {"tier": 1}, {"tier": None}, {"tier": "batch", "weight": 2}):
        status, data = await call(app, "PATCH", "/admin/tenants/acme", body)
        assert_error(status, data, 400)
    status, data = await call(app, "POST", "/admin/tenants", {"name": "b", "tier": "premium"})
    assert_error(status, data, 400, "invalid_request")
    assert data["error"]["param"] == "tier"
    status, data = await call(app, "PATCH", "/admin/tenants/nobody", {"tier": "batch"})
    assert_error(status, data, 404)
    assert len(changes) == 2 and store.get_tenant("acme").tier == "batch"


def _tier_story(cli: Cli) -> dict[str, Any]:
    out = {"create": cli.json("tenant", "create", "acme", "--tier", "interactive"),
           "set": cli.json("tenant", "set-tier", "acme", "batch"),
           "show": cli.json("tenant", "show", "acme"),
           "tiers": cli.json("tiers")}
    bad = cli("tenant", "set-tier", "acme", "gold")
    assert bad.exit_code == 2 and "gold" in bad.output  # not a tier: usage error, nothing sent
    human = cli.ok("tenant", "list").stdout
    assert "tier" in human and "batch" in human
    assert "capacity share" in cli.ok("tiers").stdout
    return out


def _check_tier_story(out: dict[str, Any]) -> None:
    assert out["create"]["tier"] == "interactive"
    assert out["set"]["tier"] == "batch" and out["show"]["tier"] == "batch"
    assert [(t["name"], t["priority"]) for t in out["tiers"]["data"]] == [(t.name, t.priority) for t in TIERS]


def test_kvgatectl_sets_and_shows_the_tier_locally(local: Cli) -> None:
    _check_tier_story(_tier_story(local))


def test_kvgatectl_sets_the_tier_through_the_admin_api(remote: tuple[Cli, TenancyStore]) -> None:
    cli, store = remote
    _check_tier_story(_tier_story(cli))
    assert store.get_tenant("acme").tier == "batch"
    missing = cli("tenant", "set-tier", "nobody", "batch")
    assert missing.exit_code == 1 and "unknown tenant" in missing.output

