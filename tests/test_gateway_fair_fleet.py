"""Fair shares across two workers over real HTTP (issue 24 item 6): tenants of weights 3 and 1 flood a gateway
with two tiny-model workers, more requests than the fleet runs at once, and in a window of steady state each
tenant's share of the generated tokens is within 10% of 0.75 / 0.25.

Each worker's fair queue weighs only the tenants waiting on it; the router (``gateway/fleet/routing.py``) keeps
every tenant waiting on every worker. Measured on a 2-core machine with the tenant-blind router (before): each
tenant with a system prompt of its own, the light tenant 0.13-0.20 of the tokens (0.32-0.48 with as many clients
as the heavy one); as many clients each, past the workers' admission bounds, the heavy one 0.60-0.63. After:
0.747-0.75 in both. The requests are not streamed (``tests/fleet_load.py`` says why)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tenancy.models import UsageRow
from tests.fleet_load import Tenant, flood, shares, tokens_between
from tests.tenancy_support import ids_prompt, make_tenant, store_of
from tests.test_gateway_support import MODEL, Server, start_server
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]  # shares of tokens: measured alone

MAX_NUM_SEQS = 4  # per worker: a few dozen clients keep both workers' fair queues busy
# Long enough per request that the gateway's own work per request (HTTP, ledger) stays small beside a worker's
# steps: with 32 tokens the clients' round trips, not the workers, set the pace and nobody waits on a worker.
BODY = {"model": MODEL, "max_tokens": 128, "ignore_eos": True, "temperature": 0}
SECONDS, WARMUP = 14.0, 4.0  # the flood; its first seconds (every client arriving at once) are not measured
# A worker's fair queue is exact only to one request per tenant (start-time fair queuing's lag bound), and with
# requests of one length its four slots free and refill together: ~4 picks a second, HHHL. Where a tie between the
# two tenants' virtual times falls (the older head wins) moves a light pick across a second's boundary, and both
# workers run in step, so a 10 s window sees 9, 10 or 11 light picks of 40 on each: 0.225-0.275, the 10% bound
# itself. Measured on a Zen 1 with the workers' picks logged: exactly 3:1, yet heavy 0.723-0.75 in 7 runs, 3 of
# them past the bound. The full-workers case measures 20 s, so that one pick is 5%, not 10%, of the light
# tenant's share: heavy 0.75-0.762 in 5 runs.
LONG_SECONDS = 24.0


@contextmanager
def _gateway(model_dir: Path, tmp_path: Path, *extra: str) -> Iterator[Server]:
    srv = start_server(model_dir, tmp_path / "gateway.log", "--max-num-seqs", str(MAX_NUM_SEQS), *extra, workers=2)
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/admin/workers", headers=srv.admin_headers, timeout=10).json(),
                   lambda body: len(body["data"]) == 2, within=120, what="both workers up")
        yield srv
    finally:
        srv.stop()


def _heavy_and_light(srv: Server, clients: tuple[int, int], shared_prefix: bool) -> list[Tenant]:
    tenants = []
    for name, weight, seed, n in (("heavy", 3.0, 10_000, clients[0]), ("light", 1.0, 50_000, clients[1])):
        tenant_id, key = make_tenant(srv, name, weight)
        # The same prompt length for both: a worker's fair queue charges a request its uncached prompt tokens.
        # The suffix is as long as the prefix so that a prefix's first, uncached, request costs twice the later
        # ones, not nine times: a tenant charged that much early waits seconds for its virtual time to come back.
        prefix = ids_prompt(64, seed) if shared_prefix else None

        def prompt(i: int, prefix: list[int] | None = prefix, seed: int = seed) -> list[int]:
            return (prefix or ids_prompt(64, seed + 5000 + i)) + ids_prompt(64, seed + i)

        tenants.append(Tenant(name, tenant_id, key, n, prompt))
    return tenants


def _measure(srv: Server, tenants: list[Tenant], seconds: float = SECONDS) -> dict[str, float]:
    started = flood(f"{srv.url}/v1/completions", tenants, BODY, seconds)
    with store_of(srv) as store:
        rows = {t.name: store.usage_rows(t.tenant_id) for t in tenants}
    return shares(rows, started + WARMUP, started + seconds)


def _assert_within_10_percent(got: dict[str, float]) -> None:
    assert abs(got["heavy"] - 0.75) <= 0.075 and abs(got["light"] - 0.25) <= 0.025, got


def test_tenants_with_system_prompts_share_two_workers_by_weight(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Prefix affinity used to pin each tenant (its own system prompt) to one worker; the heavy one, more than its
    worker's slack busier, spilled onto the light one's worker too, never the reverse."""
    with _gateway(tiny_model_dir, tmp_path) as srv:
        # Clients in proportion to weight: each tenant's backlog on a worker lasts as long as the other's, so a
        # stall of the gateway or the client (a loaded machine) drains neither first. With as many clients each,
        # any stall drained the heavy tenant's shorter backlog and the light one took the freed slots.
        tenants = _heavy_and_light(srv, (36, 12), shared_prefix=True)
        got = _measure(srv, tenants)
        with store_of(srv) as store:
            rows = [r for t in tenants for r in store.usage_rows(t.tenant_id)]
    assert [t.refused for t in tenants] == [0, 0]  # the admission bounds are not what this one is about
    _assert_within_10_percent(got)
    # Spreading a tenant costs each worker one miss on its prefix, not the prefix cache.
    assert sum(r.cached_tokens >= 64 for r in rows) >= 0.9 * len(rows), [r.cached_tokens for r in rows]


def test_full_workers_admit_by_weight(tiny_model_dir: Path, tmp_path: Path) -> None:
    """More clients than the workers' bounds (12 requests each, 24 in all), as many for each tenant: the rest are
    refused and retry. A worker full of whoever retried first used to leave the weights nothing to act on; now
    each tenant keeps its weighted share of the slots (so its backlog lasts as long as the other's too)."""
    with _gateway(tiny_model_dir, tmp_path, "--max-queued-requests", "12") as srv:
        tenants = _heavy_and_light(srv, (24, 24), shared_prefix=False)
        got = _measure(srv, tenants, LONG_SECONDS)
    assert all(t.refused for t in tenants), [t.refused for t in tenants]  # the bounds were reached
    _assert_within_10_percent(got)


def test_tokens_are_spread_from_first_token_to_end() -> None:
    t0 = time.time()
    row = UsageRow("r", "t", None, MODEL, 8, 0, 100, "length", t0, t0 + 2.0, 0.0, 2000.0)  # 100 tokens over 2 s
    assert tokens_between([row], t0 + 1.0, t0 + 5.0) == pytest.approx(50.0)
    assert shares({"a": [row], "b": []}, t0 + 1.0, t0 + 5.0) == {"a": 1.0, "b": 0.0}
