"""``kvgatectl top``: a live view of a running gateway, read from its unauthenticated ``/metrics``.

Each sample is a ``Snapshot`` of the exposition; ``compute_view`` turns two consecutive samples into numbers
(gauges from the newer one, counters as rates over the interval) and ``render_view`` turns those into Rich
renderables, so tests check the numbers without reading the screen.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from console.render import make_console

FETCH_TIMEOUT_S = 2.0
LabelKey = tuple[tuple[str, str], ...]  # a series' labels, sorted, so equal label sets compare equal
Series = dict[LabelKey, float]
_NONE = "-"
_WORKER_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class TopError(Exception):
    """The gateway could not be sampled (unreachable, an HTTP error, an exposition we cannot parse)."""


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic() when the sample arrived
    series: dict[str, Series]  # sample name (counters keep their _total) -> labels -> value


def parse_exposition(text: str, at: float) -> Snapshot:
    """Keyed on sample names: the parser strips ``_total`` from counter family names, and a ``# TYPE x
    counter`` line followed by ``x_total`` samples yields an empty family plus an untyped one."""
    series: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):  # NaN gauges (no data yet) would poison sums and JSON
                series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return Snapshot(at, series)


def fetch_snapshot(client: httpx.Client, url: str) -> Snapshot:
    target = url.rstrip("/") + "/metrics"
    try:
        response = client.get(target, timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise TopError(f"gateway unreachable: {target}: {str(e) or type(e).__name__}") from e
    if response.status_code != 200:
        raise TopError(f"gateway answered {response.status_code} at {target}")
    try:
        return parse_exposition(response.text, time.monotonic())
    except ValueError as e:
        raise TopError(f"cannot parse {target}: {e}") from e


# --- the numbers -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerRow:
    worker: str
    model: str
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # 0..1
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    preemptions: float | None
    preemptions_per_s: float | None
    prefix_cache_hit_rate: float | None  # over the interval; None without queries in it
    health: str | None = None  # idle, busy or slow (a step over 1 s while heartbeats arrive: load, not failure)
    step_seconds: float | None = None  # how long the current engine step has run


@dataclass(frozen=True)
class TenantRow:
    tenant: str
    requests_per_s: float | None
    prompt_tokens_per_s: float | None
    completion_tokens_per_s: float | None
    streams_in_flight: float | None
    rejected_per_s: float | None
    rejected: float | None
    top_reject_reason: str | None


@dataclass(frozen=True)
class TopView:
    url: str
    interval_s: float | None  # the measured time between the two samples; None on the first sample
    workers_ready: float | None
    output_tokens_per_s: float | None
    cost_per_1k_tokens: dict[str, float]  # by model_name; empty when the gateway does not export it
    workers: list[WorkerRow]
    tenants: list[TenantRow]


def _split(snap: Snapshot, name: str, by: str, where: Mapping[str, str] | None = None) -> dict[str, Series]:
    """The series of ``name`` grouped by the value of label ``by``; series without it (or with "") are left out."""
    groups: dict[str, Series] = {}
    for key, value in snap.series.get(name, {}).items():
        labels = dict(key)
        if labels.get(by) and all(labels.get(k) == v for k, v in (where or {}).items()):
            groups.setdefault(labels[by], {})[key] = value
    return groups


def _increase(prev: Series, cur: Series) -> float:
    # A series absent before started at 0 within the interval (prometheus_client creates labelled children on
    # first use); one that went down was reset (a worker restarted), and its reset is counted as 0, not < 0.
    return sum(max(0.0, value - prev.get(key, 0.0)) for key, value in cur.items())


@dataclass(frozen=True)
class _Pair:
    prev: Snapshot | None
    cur: Snapshot

    @property
    def dt(self) -> float | None:
        return None if self.prev is None or self.cur.at <= self.prev.at else self.cur.at - self.prev.at

    def values(self, name: str, by: str, **where: str) -> dict[str, float]:
        return {k: sum(s.values()) for k, s in _split(self.cur, name, by, where).items()}

    def increases(self, name: str, by: str, **where: str) -> dict[str, float] | None:
        """Per label value, the counter's increase over the interval (None on the first sample)."""
        if self.prev is None or self.dt is None:  # no interval: the first sample, or samples out of order
            return None
        before = _split(self.prev, name, by, where)
        return {k: _increase(before.get(k, {}), s) for k, s in _split(self.cur, name, by, where).items()}

    def rates(self, name: str, by: str, **where: str) -> dict[str, float]:
        increases, dt = self.increases(name, by, **where), self.dt
        return {} if increases is None or dt is None else {k: v / dt for k, v in increases.items()}


def _hit_rate(hits: dict[str, float] | None, queries: dict[str, float] | None, worker: str) -> float | None:
    asked = (queries or {}).get(worker, 0.0)
    if hits is None or asked <= 0:
        return None
    return min(1.0, hits.get(worker, 0.0) / asked)


def _worker_rows(p: _Pair) -> list[WorkerRow]:
    running, waiting = p.values("vllm:num_requests_running", "worker"), p.values("vllm:num_requests_waiting", "worker")
    kv, preempt = p.values("vllm:kv_cache_usage_perc", "worker"), p.values("vllm:num_preemptions_total", "worker")
    prompt, gen = p.rates("vllm:prompt_tokens_total", "worker"), p.rates("vllm:generation_tokens_total", "worker")
    preempt_rate = p.rates("vllm:num_preemptions_total", "worker")
    hits = p.increases("vllm:prefix_cache_hits_total", "worker")
    queries = p.increases("vllm:prefix_cache_queries_total", "worker")
    # Workers from these families only: the gateway's own per-worker histograms outlive a worker that died.
    models = {labels["worker"]: labels.get("model_name", "") for name in _WORKER_FAMILIES
              for labels in map(dict, p.cur.series.get(name, {})) if labels.get("worker")}
    step = p.values("kvgate:worker_step_seconds", "worker")
    health = {labels["worker"]: labels.get("state", "")
              for key, v in p.cur.series.get("kvgate:worker_health", {}).items()
              if v == 1 and (labels := dict(key)).get("worker")}
    return [WorkerRow(w, models[w], running.get(w), waiting.get(w), kv.get(w), prompt.get(w), gen.get(w),
                      preempt.get(w), preempt_rate.get(w), _hit_rate(hits, queries, w), health.get(w), step.get(w))
            for w in sorted(models)]


def _top_reason(p: _Pair, tenant: str) -> str | None:
    """The reason with the most rejections in the interval, then the most overall."""
    totals = p.values("kvgate:rejected_requests_total", "reason", tenant=tenant)
    recent = p.increases("kvgate:rejected_requests_total", "reason", tenant=tenant) or {}
    return max(totals, key=lambda r: (recent.get(r, 0.0), totals[r], r), default=None)


def _tenant_rows(p: _Pair) -> list[TenantRow]:
    requests = p.rates("kvgate:requests_total", "tenant")
    prompt = p.rates("kvgate:tokens_total", "tenant", kind="prompt")
    completion = p.rates("kvgate:tokens_total", "tenant", kind="completion")
    streams = p.values("kvgate:streams_in_flight", "tenant")
    rejected = p.values("kvgate:rejected_requests_total", "tenant")
    rejected_rate = p.rates("kvgate:rejected_requests_total", "tenant")
    names = set(p.values("kvgate:requests_total", "tenant")) | set(p.values("kvgate:tokens_total", "tenant"))
    names |= set(streams) | set(rejected)
    return [TenantRow(t, requests.get(t), prompt.get(t), completion.get(t), streams.get(t), rejected_rate.get(t),
                      rejected.get(t), _top_reason(p, t)) for t in sorted(names)]


def compute_view(url: str, previous: Snapshot | None, current: Snapshot) -> TopView:
    """Gauges from ``current``; rates over ``current - previous`` (None without a previous sample)."""
    p = _Pair(previous, current)
    workers = _worker_rows(p)
    outputs = [w.generation_tokens_per_s for w in workers if w.generation_tokens_per_s is not None]
    ready = current.series.get("kvgate:workers_ready")
    costs = {dict(k).get("model_name", ""): v for k, v in current.series.get("kvgate:cost_per_1k_tokens", {}).items()}
    return TopView(url, p.dt, sum(ready.values()) if ready else None, sum(outputs) if outputs else None, costs,
                   workers, _tenant_rows(p))


# --- the screen --------------------------------------------------------------------------------------------

def _num(x: float | None, spec: str = ".1f") -> str:
    return _NONE if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return _NONE if x is None else f"{x * 100:.1f}%"


def _table(title: str, *columns: str) -> Table:
    """Columns named with a leading "<" hold text (left, folded when narrow); the others numbers (right)."""
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, collapse_padding=True)
    for column in columns:
        name = column.lstrip("<")
        # min_width: Rich would rather squeeze a text column to nothing than fold numbers on an 80-column tty
        table.add_column(name, justify="left" if name != column else "right", no_wrap=name == column,
                         overflow="fold", min_width=min(len(name), 12))
    return table


def _header(view: TopView) -> Text:
    header = Text.assemble(("kvgate top ", "bold"), view.url, f"  workers {_num(view.workers_ready, 'g')}",
                           f"  output {_num(view.output_tokens_per_s)} tok/s")
    if view.cost_per_1k_tokens:
        header.append("  cost/1k tok " + " ".join(f"{m or '?'}={c:g}" for m, c in view.cost_per_1k_tokens.items()))
    header.append(f"  (over {view.interval_s:.1f} s)" if view.interval_s is not None else "  (sampling...)",
                  style="dim")
    return header


def render_view(view: TopView) -> Group:
    workers = _table("workers (tokens/s)", "<worker", "<model", "<health", "step s", "run", "wait", "KV",
                     "prompt/s", "gen/s", "preempt", "pre/s", "hit%")
    for w in view.workers:
        workers.add_row(Text(w.worker), Text(w.model), Text(w.health or _NONE), _num(w.step_seconds, ".1f"),
                        _num(w.running, "g"), _num(w.waiting, "g"),
                        _pct(w.kv_cache_usage), _num(w.prompt_tokens_per_s), _num(w.generation_tokens_per_s),
                        _num(w.preemptions, ".0f"), _num(w.preemptions_per_s, ".2f"), _pct(w.prefix_cache_hit_rate))
    tenants = _table("tenants (tokens/s)", "<tenant", "req/s", "prompt/s", "compl/s", "streams", "rej/s",
                     "rejected", "<top reject reason")
    for t in view.tenants:  # Text cells: tenant names are data, never Rich markup
        tenants.add_row(Text(t.tenant), _num(t.requests_per_s, ".2f"), _num(t.prompt_tokens_per_s),
                        _num(t.completion_tokens_per_s), _num(t.streams_in_flight, "g"), _num(t.rejected_per_s, ".2f"),
                        _num(t.rejected, ".0f"), Text(t.top_reject_reason or _NONE))
    return Group(_header(view), Text(), workers, Text(), tenants)


def render_message(url: str, message: str, style: str = "bold red") -> Group:
    return Group(Text.assemble(("kvgate top ", "bold"), url), Text(message, style=style))


# --- the command -------------------------------------------------------------------------------------------

def run_once(url: str, interval: float, json_out: bool) -> None:
    """Two samples ``interval`` apart, one frame; raises TopError when the gateway cannot be sampled."""
    with httpx.Client() as client:
        first = fetch_snapshot(client, url)
        time.sleep(interval)
        view = compute_view(url, first, fetch_snapshot(client, url))
    if json_out:
        typer.echo(json.dumps(asdict(view), indent=2))
    else:
        make_console().print(render_view(view))


def run_live(url: str, interval: float, iterations: int | None) -> None:
    """Refreshes every ``interval`` seconds until Ctrl-C (or ``iterations`` frames); an unreachable gateway is
    shown on screen, not raised, so the view survives a gateway restart."""
    previous: Snapshot | None = None
    frames = 0
    with httpx.Client() as client, Live(render_message(url, "sampling...", "dim"), console=make_console(),
                                        refresh_per_second=4) as live:
        while iterations is None or frames < iterations:
            if frames:
                time.sleep(interval)
            try:
                current = fetch_snapshot(client, url)
                live.update(render_view(compute_view(url, previous, current)), refresh=True)
                previous = current
            except TopError as e:
                live.update(render_message(url, str(e)), refresh=True)
            frames += 1


def run_top(url: str, interval: float, once: bool, iterations: int | None, json_out: bool) -> None:
    if once or json_out:
        run_once(url, interval, json_out)
        return
    try:
        run_live(url, interval, iterations)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how one leaves a live view: a normal exit, not Click's "Aborted!"
