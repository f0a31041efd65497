"""Several gateways, one deployment (issue 14, item 2): two `kvgate serve` processes, each with its own CPU worker
on the tiny model, share one PostgreSQL store (a private cluster, tests/postgres_support.py) and one private
Redis. A tenant's rpm, tpm and concurrency limits hold across both under a concurrent burst, the ledger counts each
request once, and an admin change made through one gateway reaches the other within its auth cache time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tenancy.models import Quota
from tests.postgres_support import PostgresCluster
from tests.redis_support import RedisServer
from tests.tenancy_support import Outcome, ids_prompt, make_tenant, run_concurrently, store_of
from tests.test_gateway_support import MODEL, Server, start_server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

COMP = "/v1/completions"
LEDGER_WAIT_S = 30.0  # the ledger writes in group commits: rows land shortly after the responses


def _body(seed: int, max_tokens: int = 2, **kw: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": ids_prompt(10, seed), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def gateways(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
             postgres_cluster: PostgresCluster) -> Iterator[tuple[Server, Server]]:
    """Shared by the module's tests: each makes a tenant of its own name, so its limits, buckets and ledger rows
    are its own, and none stops or reconfigures a gateway or the Redis they share."""
    logs, postgres_url = tmp_path_factory.mktemp("scaleout"), postgres_cluster.create_database()
    # start_server passes db_path through as the --db argument: here the shared database's URL (kept a str).
    a = start_server(tiny_model_dir, logs / "a.log", "--redis-url", redis_server.url,
                     db_path=postgres_url)  # type: ignore[arg-type]
    try:
        b = start_server(tiny_model_dir, logs / "b.log", "--redis-url", redis_server.url, "--no-demo-tenant",
                         db_path=postgres_url, secret=a.secret)  # type: ignore[arg-type]
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


def _ledger_ids(server: Server, tenant_id: str, expected: int) -> list[str]:
    """The tenant's ledger rows' request ids once `expected` have landed."""
    def ids() -> list[str]:
        with store_of(server) as store:
            return [r.request_id for r in store.usage_rows(tenant_id)]

    return wait_until(ids, lambda found: len(found) >= expected, within=LEDGER_WAIT_S,
                      what=f"{expected} ledger rows", interval=0.2)


def _burst(a: Server, b: Server, key: str, n: int, seed: int) -> tuple[list[Outcome], float]:
    calls = [(f"{(a, b)[i % 2].url}{COMP}", key, _body(seed + i)) for i in range(n)]
    t0 = time.monotonic()
    outs = run_concurrently(calls)
    return outs, time.monotonic() - t0


def test_rpm_holds_across_two_gateways_and_the_ledger_counts_each_request_once(
        gateways: tuple[Server, Server]) -> None:
    a, b = gateways
    assert a.db_path == b.db_path and str(a.db_path).startswith("postgresql://")
    rpm = 12
    tenant_id, key = make_tenant(a, "burst-rpm", quota=Quota(rpm=rpm))
    outs, elapsed = _burst(a, b, key, 4 * rpm, 0)
    assert all(o.status in (200, 429) for o in outs), [o.status for o in outs]
    ok = [o for o in outs if o.status == 200]
    # One bucket for both gateways (refilling rpm/60 per second): two separate limits would admit 2 x rpm.
    assert rpm <= len(ok) <= rpm + elapsed * rpm / 60.0
    ids = _ledger_ids(b, tenant_id, len(ok))
    assert sorted(ids) == sorted(o.body["id"] for o in ok)  # each admitted request once, nothing else


def test_tpm_holds_across_two_gateways(gateways: tuple[Server, Server]) -> None:
    a, b = gateways
    tpm, cost = 240, 12  # each request: 10 prompt + 2 completion tokens
    tenant_id, key = make_tenant(b, "burst-tpm", quota=Quota(tpm=tpm))
    outs, elapsed = _burst(a, b, key, 60, 1000)
    assert all(o.status in (200, 429) for o in outs), [o.status for o in outs]
    ok = [o for o in outs if o.status == 200]
    assert 0 < len(ok) * cost <= tpm + elapsed * tpm / 60.0
    assert len(ok) * cost >= tpm - cost  # the limit was used up, not refused early
    assert {o.headers["x-ratelimit-limit-tokens"] for o in ok} == {str(tpm)}
    assert sorted(_ledger_ids(a, tenant_id, len(ok))) == sorted(o.body["id"] for o in ok)


def test_concurrency_limit_holds_across_two_gateways(gateways: tuple[Server, Server]) -> None:
    """Two streams hold the tenant's two slots, one on each gateway; a third request to either is refused until
    a stream ends."""
    a, b = gateways
    _, key = make_tenant(a, "two-at-a-time", quota=Quota(max_concurrent=2))
    headers = {"Authorization": f"Bearer {key}"}
    long_stream = _body(7, max_tokens=3000, stream=True)  # far longer than the test: it holds its slot
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{a.url}{COMP}", json=long_stream, headers=headers) as sa, \
                client.stream("POST", f"{b.url}{COMP}", json={**long_stream, "prompt": ids_prompt(10, 8)},
                              headers=headers) as sb:
            assert (sa.status_code, sb.status_code) == (200, 200)
            lines_a, lines_b = sa.iter_lines(), sb.iter_lines()
            assert next(lines_a).startswith("data: ") and next(lines_b).startswith("data: ")  # both generating
            refused = [client.post(f"{s.url}{COMP}", json=_body(9), headers=headers) for s in (a, b)]
            assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]
            assert {r.json()["error"]["code"] for r in refused} == {"concurrency_limit_exceeded"}
        # Both streams closed (the client went away: their slots are released).
        r = wait_until(lambda: client.post(f"{b.url}{COMP}", json=_body(10), headers=headers),
                       lambda r: r.status_code != 429, within=30.0, what="a slot free again", interval=0.2)
        assert r.status_code == 200, r.text


def test_admin_change_through_one_gateway_reaches_the_other(gateways: tuple[Server, Server]) -> None:
    a, b = gateways
    _, key = make_tenant(a, "suspend-me")
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{b.url}{COMP}", json=_body(20), headers=headers, timeout=30).status_code == 200
    changed = httpx.post(f"{a.url}/admin/tenants/suspend-me/suspend", headers=a.admin_headers, timeout=30)
    assert changed.status_code == 200 and changed.json()["status"] == "suspended"
    # b cached the tenant as active; its auth cache (1 s by default) expires and b reads the shared store.
    r = wait_until(lambda: httpx.post(f"{b.url}{COMP}", json=_body(21), headers=headers, timeout=30),
                   lambda r: r.status_code != 200, within=15.0, what="the suspension seen by b", interval=0.2)
    assert r.status_code == 403, r.text
