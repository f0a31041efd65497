"""A closed-loop load generator for fairness tests over real HTTP: each tenant runs a number of clients that send
one completion after another (retrying a 503 after a short pause, as a client honouring it loosely would) for a
fixed time; the gateway's ledger rows (first token, end) then say each tenant's share of the tokens generated in a
window of steady state. Not streamed: on a small machine the gateway's per-token SSE work would become the
bottleneck, and a client reading one stream per connection gets the same rate as any other, whatever its weight."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import trio

from tenancy.models import UsageRow

RETRY_503_S = 0.5  # a refused client comes back soon (the gateway says 1 s or more; a retrying SDK waits about this)


@dataclass
class Tenant:
    """One tenant's load: ``clients`` loops of completions whose prompts ``prompt(i)`` makes (i counts up)."""

    name: str
    tenant_id: str
    key: str
    clients: int
    prompt: Callable[[int], list[int]]
    refused: int = 0  # 503s


async def _client(http: httpx.AsyncClient, url: str, t: Tenant, body: dict[str, object], seq: list[int],
                  stop_at: float) -> None:
    headers = {"Authorization": f"Bearer {t.key}"}
    while time.time() < stop_at:
        seq[0] += 1
        r = await http.post(url, json={**body, "prompt": t.prompt(seq[0])}, headers=headers)
        if r.status_code == 503:
            t.refused += 1
            await trio.sleep(RETRY_503_S)
        elif r.status_code != 200:
            raise AssertionError(f"{t.name}: {r.status_code} {r.text[:500]}")


def flood(url: str, tenants: list[Tenant], body: dict[str, object], seconds: float) -> float:
    """Runs every tenant's clients at once for ``seconds`` (then lets the requests in flight finish); returns
    the wall-clock time they started (the ledger's clock)."""
    started = time.time()

    async def main() -> None:
        total = sum(t.clients for t in tenants)
        limits = httpx.Limits(max_connections=total, max_keepalive_connections=total)
        async with httpx.AsyncClient(timeout=seconds + 60, limits=limits) as http:
            async with trio.open_nursery() as nursery:
                for t in tenants:
                    seq = [0]  # shared by the tenant's clients: every request gets a prompt of its own
                    for _ in range(t.clients):
                        nursery.start_soon(_client, http, url, t, body, seq, started + seconds)

    trio.run(main)
    return started


def tokens_between(rows: list[UsageRow], start: float, end: float) -> float:
    """Completion tokens generated in [start, end): each row's tokens spread evenly from its first token to its
    end (the gateway's view of generation: outputs arrive there step by step, whatever the client reads)."""
    total = 0.0
    for r in rows:
        if r.ttft_ms is None or r.latency_ms is None or not r.completion_tokens:
            continue
        a, b = r.started_at + r.ttft_ms / 1000.0, r.started_at + r.latency_ms / 1000.0
        overlap = min(b, end) - max(a, start)
        if b <= a:
            total += r.completion_tokens if start <= a < end else 0
        elif overlap > 0:
            total += r.completion_tokens * overlap / (b - a)
    return total


def shares(rows: dict[str, list[UsageRow]], start: float, end: float) -> dict[str, float]:
    """Each tenant's share of the tokens generated in the window (``rows``: the ledger's rows by tenant)."""
    counts = {name: tokens_between(rs, start, end) for name, rs in rows.items()}
    total = max(1.0, sum(counts.values()))
    return {name: round(n / total, 3) for name, n in counts.items()}
