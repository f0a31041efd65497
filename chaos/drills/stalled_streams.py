"""Stalled streams: a thousand streaming clients that read their response head and then never read again.

Each client is a raw socket with a small receive buffer: its events back up through TCP into the gateway while
its worker goes on generating. What the gateway holds for them is bounded (``gateway/base/handle.py``) by
``MAX_PENDING_BYTES`` (1 MiB) of untaken output per stream and the ``PendingBudget`` of all streams together
(256 MiB; past it a stream holding over ``CUTTABLE_BYTES``, 16 KiB, is cut), both enforced at a cut that aborts
the stream on its worker; and by the gateway's ``--stream-stall-timeout`` (60 s by default; the quick size runs
5 s so CI does not wait a minute), after which a stream whose client took nothing is dropped. Which comes first
depends on how fast the worker makes tokens: the drill reports it (the pool logs each cut by a bound), and judges
what must hold either way. No flag or variable sets the budget (``WorkerPool`` makes ``PendingBudget()`` with its
default), so the drill sizes the load: every stream runs at once, and at the default size the per-stream bounds
alone would allow 1,000 MiB.

The model only paces the tokens, so both sizes use the tiny random model (``smollm2`` would take an hour).

Verdict: the gateway's RSS grows by no more than ``RSS_FACTOR`` x the pending bound (``min(streams x 1 MiB,
256 MiB + streams x 16 KiB)``); the peak of untaken outputs (``kvgate:ipc_pending_outputs`` at the handle's own
size estimate) stays under the pending bound; the worker holds nothing for the streams while their sockets are
still open (KV freed by the cut, not by the clients leaving); every admitted stream gets its ledger row, billed
for the tokens its worker generated (the worker's own count, less what it made between a cut and its abort); a
normal request is served while the stalled sockets are open, and after.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

import trio

from chaos import ledger
from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks
from chaos.drills.streams import COMPLETIONS
from chaos.metrics import MetricsWatch, Snapshot, scrape
from chaos.procs import RssWatch
from chaos.rawhttp import build
from chaos.target import still_serves
from chaos.verdict import Check, DrillResult, at_most, check, equal, skipped
from gateway.base.handle import CUTTABLE_BYTES, MAX_GATEWAY_PENDING_BYTES, MAX_PENDING_BYTES, output_bytes
from ipc.messages import RequestOutputMsg

RCVBUF = 2048  # the kernel doubles it: a few events fill it, so backpressure reaches the gateway at once
LOGPROBS = 20  # ~2.8 KB per output at the handle's estimate: a stream reaches 1 MiB in ~370 tokens
MAX_TOKENS = 4000  # far past any bound: every stream is cut, none finishes
# Gateway RSS growth allowed per byte of the pending bound, as the slow-readers drill allows 2 MiB a stream for a
# 1 MiB bound: RSS also holds each stream's connection and 16-event SSE buffer, a step's outputs decoded for all
# streams at once, and what the allocator keeps of cut streams' freed outputs (the handle's estimate counts only
# the outputs' own objects). Without the global budget 1,000 streams would reach ~1.4 GiB, past 2 x 272 MiB.
RSS_FACTOR = 2.0
ROWS_AFTER_STALL_S = 60.0  # ledger rows land a stall timeout after the last event went out, and then some
BILLING_SLACK_TOKENS = 8  # per stream: tokens a worker makes between the gateway's cut and the abort reaching it
PENDING = "kvgate:ipc_pending_outputs"
GENERATED = "vllm:generation_tokens_total"
WORKER_HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "kvgate:gateway_requests_in_flight")
MiB = 1 << 20
CUT_LOG = "cut: its client fell too far behind"  # gateway/fleet/pool.py, once a stream passes a pending bound


@dataclass(frozen=True)
class Size:
    streams: int
    cut_within_s: float  # until the worker holds nothing for them (the bounds cut, aborts reach the worker)
    stall_s: float  # the deployment's --stream-stall-timeout

    @property
    def rows_within_s(self) -> float:
        return self.stall_s + ROWS_AFTER_STALL_S


def pending_bound(streams: int) -> int:
    """What the two bounds of handle.py let ``streams`` stalled streams hold together (estimated bytes)."""
    return min(streams * MAX_PENDING_BYTES, MAX_GATEWAY_PENDING_BYTES + streams * CUTTABLE_BYTES)


def output_estimate() -> int:
    """The handle's own estimate of one streamed output of one token with LOGPROBS alternatives."""
    return output_bytes(RequestOutputMsg("x", [1], None, 0, [(0.0, [(i, 0.0) for i in range(LOGPROBS)])], None, None))


@dataclass(frozen=True)
class Held:
    """What was seen while the stalled sockets were open."""

    admitted: int
    served: bool  # the normal request
    how: str
    freed_after: float | None  # seconds until the worker held nothing for them
    rows: int | None  # the load key's ledger rows
    rows_after: float | None  # seconds (after the worker was freed) until every admitted stream had its row


class StalledClient:
    """Sends its request, reads the response head, then holds the socket without reading until ``stop``."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.status: int | None = None
        self.failed: str | None = None

    async def run(self, heads: trio.CapacityLimiter, headed: list[int], stop: trio.Event) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        with sock:
            try:
                async with heads:  # bounded at once: a thousand handshakes in one burst is another drill
                    with trio.fail_after(120):
                        await sock.connect((self.host, self.port))
                        await sock.send(self.request)
                        self.status = await self._head(sock)
            except (OSError, trio.TooSlowError) as e:
                self.failed = type(e).__name__
            headed.append(1)
            await stop.wait()

    async def _head(self, sock: trio.socket.SocketType) -> int | None:
        got = b""
        while b"\r\n\r\n" not in got and len(got) < 16384:
            chunk = await sock.recv(1024)
            if not chunk:
                break
            got += chunk
        parts = got.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


class StalledStreams(Drill):
    name = "stalled-streams"
    summary = ("1,000 streams whose clients stop reading after the response head: gateway memory within the "
               "pending-output bounds (1 MiB a stream, 256 MiB in all), the worker freed while the sockets are "
               "still open, every stream billed in the ledger, a normal request served meanwhile")
    needs_processes = True
    _cuts_before = 0
    time_limit_s: ClassVar[tuple[float, float]] = (600.0, 1500.0)
    SIZES: ClassVar[dict[bool, Size]] = {True: Size(200, 240.0, 5.0), False: Size(1000, 600.0, 60.0)}

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        from chaos.tiny_model import tiny_model_dir

        n, stall = self.SIZES[sizing.quick].streams, self.SIZES[sizing.quick].stall_s
        # Every stream runs at once (so all of them fill their buffers together); the KV holds each one's
        # prompt and the tokens it makes until its cut (~400), with room to spare.
        return DeploymentSpec(str(tiny_model_dir()), torch_threads=1, serve_args=(
            "--max-num-seqs", str(n + 16), "--max-queued-requests", str(n + 64),
            "--kv-cache-tokens", str((n + 16) * 768), "--stream-stall-timeout", f"{stall:g}"))

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        size = self.SIZES[ctx.sizing.quick]
        result.load = (f"{size.streams} completion streams (16-token prompts, up to {MAX_TOKENS} tokens, logprobs "
                       f"{LOGPROBS}) whose clients read the response head and then nothing ({RCVBUF} B receive "
                       "buffer), all generating at once; a normal request meanwhile and after")
        parts = urlsplit(ctx.target.url)
        clients = [StalledClient(parts.hostname or "127.0.0.1", parts.port or 80, self._request(ctx))
                   for _ in range(size.streams)]
        before = await scrape(ctx.client, ctx.target.url)
        since = time.time()
        self._cuts_before = ctx.deployment.log_text().count(CUT_LOG) if ctx.deployment is not None else 0
        rss = RssWatch({"gateway": ctx.gateway_pid}) if ctx.gateway_pid else None
        backlog = MetricsWatch(ctx.client, ctx.target.url, (PENDING,), interval=0.5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backlog.run)
            if rss is not None:
                nursery.start_soon(rss.run)
            held = await self._hold(ctx, size, clients, since)
            nursery.cancel_scope.cancel()
        self._cuts(ctx, result, held.admitted)
        result.add(*self._admission(result, clients))
        result.add(*self._memory(result, rss, backlog, held.admitted))
        result.add(check("a normal request served while the stalled sockets are open", held.served, held.how))
        result.add(check(f"the worker holds nothing for them within {size.cut_within_s:g}s, sockets still open",
                         held.freed_after is not None,
                         "never" if held.freed_after is None else f"after {held.freed_after:.0f}s"))
        result.add(check(f"a ledger row for every admitted stream within {size.rows_within_s:g}s, sockets still open",
                         held.rows_after is not None, f"{held.rows} of {held.admitted} rows" + (
                             "" if held.rows_after is None else
                             f", the last {held.rows_after:.0f}s after the worker was freed")))
        result.add(*await self._billing(ctx, result, since, held.admitted, held.rows, before))
        serves, how = await still_serves(ctx.client, ctx.target)
        result.add(check("still serving after the clients left", serves, how))
        result.add(*await quiet_checks(ctx, within=60.0))

    async def _hold(self, ctx: DrillContext, size: Size, clients: list[StalledClient], since: float) -> Held:
        """Open every stalled stream, then, while their sockets stay open and unread: a normal request, the wait
        for the worker to hold nothing for them, and the wait for their ledger rows. The sockets close after."""
        stop, heads = trio.Event(), trio.CapacityLimiter(64)
        headed: list[int] = []
        async with trio.open_nursery() as nursery:
            for c in clients:
                nursery.start_soon(c.run, heads, headed, stop)
            with trio.move_on_after(180):
                while len(headed) < len(clients):
                    await trio.sleep(0.2)
            ctx.say(f"{len(headed)} of {len(clients)} stalled clients have their response head")
            served, how = await still_serves(ctx.client, ctx.target, timeout=180.0)
            freed_after = await self._wait_freed(ctx, size.cut_within_s)
            ctx.say(f"the worker holds nothing for them after {freed_after or -1:.0f}s; waiting for their ledger rows")
            admitted = sum(1 for c in clients if c.status == 200)
            rows, rows_after = await self._wait_rows(ctx, since, admitted, size.rows_within_s)
            stop.set()
        return Held(admitted, served, how, freed_after, rows, rows_after)

    def _request(self, ctx: DrillContext) -> bytes:
        body = json.dumps(ctx.completion(prompt_ids(ctx.rng, 16), MAX_TOKENS, logprobs=LOGPROBS)).encode()
        return build("POST", COMPLETIONS, body, [(b"Authorization", f"Bearer {ctx.target.api_key}".encode()),
                                                 (b"Content-Type", b"application/json")])

    async def _wait_freed(self, ctx: DrillContext, within: float) -> float | None:
        """Seconds until no request runs or waits on the worker, it holds no KV block for one, and the gateway
        tracks none: every stalled stream was cut and aborted (the probe request is long done by then)."""
        start = trio.current_time()
        with trio.move_on_after(within):
            while True:
                snap = await scrape(ctx.client, ctx.target.url)
                if not any(snap.total(s) for s in WORKER_HELD):
                    break
                await trio.sleep(0.5)
            return trio.current_time() - start
        return None

    def _cuts(self, ctx: DrillContext, result: DrillResult, admitted: int) -> None:
        """Which mechanism cut the streams: the pool logs each cut by a pending bound (per stream or the global
        budget; its KV is freed at once); the rest ended when their producer had waited the stall timeout on a
        client that took nothing. Reported, not judged: which comes first is a matter of how fast the
        worker generates, and either bounds what the gateway holds."""
        if ctx.deployment is None:
            return
        by_bounds = ctx.deployment.log_text().count(CUT_LOG) - self._cuts_before
        result.measurements["cut_by_pending_bounds"] = by_bounds
        result.measurements["cut_by_consumer_stall"] = max(0, admitted - by_bounds)

    async def _wait_rows(self, ctx: DrillContext, since: float, admitted: int,
                         within: float) -> tuple[int | None, float | None]:
        """The load key's row count once it reaches ``admitted`` (and after how long), or where it stood after
        ``within`` s. A stream cut by a bound has its row written when its producer gives up on the client (the
        stall timeout after its last event went out), not at the cut: the sockets stay open meanwhile."""
        start = trio.current_time()
        n = await ledger.count(ctx.client, ctx.target, since)
        with trio.move_on_after(within):
            while n is not None and n < admitted:
                await trio.sleep(1.0)
                n = await ledger.count(ctx.client, ctx.target, since)
            return n, trio.current_time() - start
        return n, None

    def _admission(self, result: DrillResult, clients: list[StalledClient]) -> list[Check]:
        statuses: dict[str, int] = {}
        for c in clients:
            key = c.failed or str(c.status)
            statuses[key] = statuses.get(key, 0) + 1
        result.outcomes.update({f"stalled {k}": v for k, v in sorted(statuses.items())})
        admitted = statuses.get("200", 0)
        return [check("every stalled stream admitted (200) or refused with 429/503, none failed",
                      sum(v for k, v in statuses.items() if k in ("200", "429", "503")) == len(clients),
                      ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))),
                check("most streams admitted (the bounds are what is measured)", admitted >= len(clients) // 2,
                      f"{admitted} of {len(clients)}")]

    def _memory(self, result: DrillResult, rss: RssWatch | None, backlog: MetricsWatch,
                admitted: int) -> list[Check]:
        bound = pending_bound(admitted)
        peak = backlog.peak[PENDING] * output_estimate()
        result.measurements["pending_bound_mib"] = round(bound / MiB, 1)
        result.measurements["per_stream_bounds_alone_mib"] = round(admitted * MAX_PENDING_BYTES / MiB, 1)
        result.measurements["peak_pending_outputs"] = int(backlog.peak[PENDING])
        result.measurements["peak_pending_estimated_mib"] = round(peak / MiB, 1)
        out = [at_most("peak untaken output (outputs x the handle's estimate) <= the pending bound",
                       round(peak / MiB, 1), round(bound / MiB, 1), " MiB")]
        if rss is None:
            return [*out, skipped("gateway RSS growth bounded", "the gateway's pid is not visible here")]
        result.measurements["gateway_rss_growth_mib"] = round(rss.growth_mib("gateway"), 1)
        return [*out, at_most(f"gateway RSS growth <= {RSS_FACTOR:g} x the pending bound",
                              round(rss.growth_mib("gateway"), 1), round(RSS_FACTOR * bound / MiB, 1), " MiB")]

    async def _billing(self, ctx: DrillContext, result: DrillResult, since: float, admitted: int,
                       rows_seen: int | None, before: Snapshot) -> list[Check]:
        rows = await ledger.rows(ctx.target, since)
        if rows is None:
            return [skipped("every stalled stream billed", "the ledger's rows are not readable here")
                    if rows_seen is None else equal("one ledger row per admitted stream", rows_seen, admitted)]
        await trio.sleep(1.0)  # the worker's next heartbeat carries its final token count
        generated = (await scrape(ctx.client, ctx.target.url)).total(GENERATED) - before.total(GENERATED)
        billed = sum(r.completion_tokens for r in rows)
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        status_text = ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
        result.measurements["ledger_statuses"] = status_text
        result.measurements["tokens_billed"], result.measurements["tokens_generated"] = billed, int(generated)
        tokens = sorted(r.completion_tokens for r in rows)
        if tokens:
            result.measurements["billed_per_stream_min_median_max"] = (
                f"{tokens[0]} / {tokens[len(tokens) // 2]} / {tokens[-1]}")
        unbilled = generated - billed
        return [equal("one ledger row per admitted stream", len(rows), admitted),
                check("each row billed (completion tokens > 0, status cancelled or client_too_slow)",
                      all(r.completion_tokens > 0 and r.status in ("cancelled", "client_too_slow") for r in rows),
                      status_text or "no rows"),
                check(f"billed = what the worker generated, less <= {BILLING_SLACK_TOKENS} tokens a stream made "
                      "after its cut", 0 <= unbilled <= BILLING_SLACK_TOKENS * admitted,
                      f"generated {generated:g} (with the probe request's few), billed {billed}")]
