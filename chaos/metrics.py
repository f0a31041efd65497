"""Reading a deployment's own ``/metrics``: one snapshot as a flat sample table, and the wait for quiet.

"Quiet" is what every drill checks once its fault is over: no request running or waiting on any worker, no KV
block held by a request (``vllm:kv_cache_usage_perc`` counts only blocks live requests hold; cached-but-free
blocks count as free), nothing the gateway still tracks, no SSE stream open.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

QUIET_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "kvgate:gateway_requests_in_flight", "kvgate:streams_in_flight")


@dataclass(frozen=True)
class Snapshot:
    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample called ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for n, lab, v in self.samples if n == name and want <= set(lab))

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, lab, v in self.samples:
            if n == name:
                key = dict(lab).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def quiet_values(self) -> dict[str, float]:
        return {name: self.total(name) for name in QUIET_SERIES}


def parse(text: str) -> Snapshot:
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return Snapshot(tuple(samples))


async def scrape(client: httpx.AsyncClient, url: str) -> Snapshot:
    with trio.fail_after(15):
        r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    return parse(r.text)


async def wait_quiet(client: httpx.AsyncClient, url: str, within: float) -> tuple[bool, float, Snapshot]:
    """Poll ``/metrics`` until every quiet series is 0 (True) or ``within`` seconds pass (False); also returns the
    seconds it took and the last snapshot. Needs at least one worker reporting: a deployment with no worker is
    not quiet, it is down."""
    start = trio.current_time()
    snap = await scrape(client, url)
    while trio.current_time() - start < within:
        if snap.has("vllm:num_requests_running") and not any(snap.quiet_values().values()):
            return True, trio.current_time() - start, snap
        await trio.sleep(0.2)
        snap = await scrape(client, url)
    quiet = snap.has("vllm:num_requests_running") and not any(snap.quiet_values().values())
    return quiet, trio.current_time() - start, snap


def quiet_detail(snap: Snapshot) -> str:
    values = snap.quiet_values()
    short = {name.split(":", 1)[1]: v for name, v in values.items()}
    return ", ".join(f"{k}={v:g}" for k, v in short.items())


class MetricsWatch:
    """Samples ``/metrics`` every ``interval`` s while a load runs and keeps the peak of each named series (summed
    over labels); run it in a nursery and cancel it after. A failed scrape is counted, not fatal: the gateway
    answering /metrics slowly under load is something to report, not a reason to stop watching."""

    def __init__(self, client: httpx.AsyncClient, url: str, series: tuple[str, ...], interval: float = 0.25) -> None:
        self.client, self.url, self.series, self.interval = client, url, series, interval
        self.peak: dict[str, float] = {name: 0.0 for name in series}
        self.failed_scrapes = 0
        self.scrapes = 0

    async def run(self) -> None:
        while True:
            try:
                snap = await scrape(self.client, self.url)
            except (httpx.HTTPError, trio.TooSlowError):
                self.failed_scrapes += 1
            else:
                self.scrapes += 1
                for name in self.series:
                    self.peak[name] = max(self.peak[name], snap.total(name))
            await trio.sleep(self.interval)
