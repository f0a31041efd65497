"""A bounded async load generator that accounts for every request it sends.

Each ``RequestSpec`` becomes one HTTP exchange (httpx on Trio, streaming SSE when the body asks for a stream)
that ends as exactly one ``Outcome``: completed, a clean error event inside a 200 stream, refused (429/503),
rejected (another 4xx), a server error (other 5xx), a transport error, a truncated stream (closed without
``[DONE]``), dropped on purpose (the spec said when), or hung (no end by its deadline). Bounded in count (the
specs given) and in time (every request has a deadline); concurrency is a ``CapacityLimiter``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from chaos.sse import ERROR_KEYS, SSEReader, error_of

# Every other kind (hung, truncated, transport, server_error) is a failure of the deployment.
CLEAN_KINDS = ("completed", "error_event", "refused", "rejected", "dropped", "not_sent")
MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True)
class Drop:
    """When the client goes away on purpose: ``after_s`` after sending (possibly before any response), or after
    ``after_events`` SSE data events (0: as soon as the response headers arrived)."""

    after_s: float | None = None
    after_events: int | None = None
    label: str = ""


@dataclass(frozen=True)
class RequestSpec:
    route: str
    body: dict[str, Any]
    deadline_s: float = 60.0
    drop: Drop | None = None
    api_key: str | None = None  # another key than the load's own
    read_pause_s: float = 0.0  # sleep between events read (a slow consumer)
    send_after_s: float = 0.0  # open-loop load: sent this long after its run began (arrivals on a schedule)


@dataclass
class Outcome:
    index: int
    kind: str = "not_sent"  # "hung" from the moment it is sent until it ends
    status: int | None = None
    code: str | None = None  # OpenAI error code of a refusal or an error event
    retry_after: str | None = None
    shape_ok: bool = True  # every error seen had OpenAI's shape {"error": {message, type, param, code}}
    request_id: str | None = None
    drop_label: str = ""
    streamed: bool = False  # asked for SSE (a plain response has no first-token time of its own)
    started: float = 0.0  # trio clock
    headers_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0  # content-bearing events
    gaps: list[float] = field(default_factory=list)  # seconds between content events

    @property
    def admitted(self) -> bool:
        """A 200 came back: the gateway handed the request to a worker."""
        return self.status == 200

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def clean(self) -> bool:
        return self.kind in CLEAN_KINDS and self.shape_ok


class LoadGenerator:
    """Runs specs against one gateway; drills watch its live counters while it runs."""

    def __init__(self, url: str, api_key: str, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.url, self.api_key, self.concurrency = url, api_key, concurrency
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.streaming: set[int] = set()  # requests that have seen a content event and not ended
        self._progress = trio.Event()  # set (and replaced) whenever a request starts streaming or ends
        self._scopes: set[trio.CancelScope] = set()  # one per run() in progress

    async def run(self, specs: Sequence[RequestSpec]) -> list[Outcome]:
        limiter = trio.CapacityLimiter(self.concurrency)
        base = len(self.outcomes)
        self.outcomes.extend(Outcome(base + i) for i in range(len(specs)))
        async with self._client() as client:
            async with trio.open_nursery() as nursery:
                for i, spec in enumerate(specs):
                    nursery.start_soon(self._one, client, limiter, spec, self.outcomes[base + i])
        return self.outcomes[base:]

    async def run_until(self, stop: trio.Event, make_spec: Callable[[int], RequestSpec]) -> list[Outcome]:
        """``concurrency`` clients, each sending its next request (``make_spec(n)``, n counting from 0) as soon as
        its last one ended, until ``stop`` is set; what is in flight then runs to its end. Steady load across an
        event of unknown length (a rolling restart), with no gap between one request and the next."""
        base = len(self.outcomes)
        limiter = trio.CapacityLimiter(self.concurrency)
        counter = iter(range(2**62))

        async def client_loop(client: httpx.AsyncClient) -> None:
            while not stop.is_set():
                out = Outcome(len(self.outcomes))
                self.outcomes.append(out)
                await self._one(client, limiter, make_spec(next(counter)), out)

        async with self._client() as client:
            async with trio.open_nursery() as nursery:
                for _ in range(self.concurrency):
                    nursery.start_soon(client_loop, client)
        return self.outcomes[base:]

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[httpx.AsyncClient]:
        """One HTTP client for a run, in a cancel scope that ``stop`` cancels."""
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        timeout = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)  # deadlines are per request
        scope = trio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
                    yield client
        finally:
            self._scopes.discard(scope)

    def stop(self) -> None:
        """End every run of this load now: whatever has not ended by itself counts as hung."""
        for scope in self._scopes:
            scope.cancel()

    async def wait_done(self, timeout: float) -> bool:
        """Until every request sent so far has ended (True) or ``timeout`` passes (False)."""
        with trio.move_on_after(timeout):
            while self.in_flight or any(o.kind == "not_sent" for o in self.outcomes):
                await self._progress.wait()
            return True
        return False

    async def wait_streaming(self, n: int, timeout: float) -> bool:
        """Until ``n`` requests are streaming at once (True), or all ended / timeout (False)."""
        with trio.move_on_after(timeout):
            while len(self.streaming) < n:
                if self.outcomes and self.in_flight == 0 and all(o.ended_at for o in self.outcomes):
                    return False
                await self._progress.wait()
            return True
        return False

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def _one(self, client: httpx.AsyncClient, limiter: trio.CapacityLimiter, spec: RequestSpec,
                   out: Outcome) -> None:
        if spec.send_after_s > 0:
            await trio.sleep(spec.send_after_s)
        async with limiter:
            self.in_flight += 1
            out.kind, out.started = "hung", trio.current_time()
            out.streamed = bool(spec.body.get("stream"))
            out.drop_label = spec.drop.label if spec.drop else ""
            ended = False
            try:
                await self._bounded(client, spec, out)
                ended = True
            finally:
                self.in_flight -= 1
                self.streaming.discard(out.index)
                if not ended:  # the load was stopped under it: it had not ended by then
                    out.kind = "hung"
                elif out.kind != "hung":
                    out.ended_at = out.ended_at or trio.current_time()
                self._notify()

    async def _bounded(self, client: httpx.AsyncClient, spec: RequestSpec, out: Outcome) -> None:
        drop_s = spec.drop.after_s if spec.drop is not None else None
        limit = spec.deadline_s if drop_s is None else min(spec.deadline_s, drop_s)
        with trio.move_on_after(limit) as scope:
            try:
                await self._exchange(client, spec, out)
            except httpx.TransportError as e:
                out.kind = "transport" if out.headers_at is None else "truncated"
                out.code = type(e).__name__
        if scope.cancelled_caught:
            out.kind = "dropped" if drop_s is not None and drop_s <= spec.deadline_s else "hung"

    async def _exchange(self, client: httpx.AsyncClient, spec: RequestSpec, out: Outcome) -> None:
        headers = {"Authorization": f"Bearer {spec.api_key or self.api_key}"}
        async with client.stream("POST", spec.route, json=spec.body, headers=headers) as r:
            out.headers_at = trio.current_time()
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                await self._refusal(r, out)
            elif spec.body.get("stream"):
                await self._stream(r, spec, out)
            else:
                await self._plain(r, out)

    async def _refusal(self, r: httpx.Response, out: Outcome) -> None:
        raw = await _read_bounded(r)
        err = error_of(raw)
        out.shape_ok = err is not None
        out.code = str(err.get("code")) if err is not None else None
        status = r.status_code
        out.kind = ("refused" if status in (429, 503) else "rejected" if 400 <= status < 500 else "server_error")
        out.ended_at = trio.current_time()

    async def _plain(self, r: httpx.Response, out: Outcome) -> None:
        body = json.loads(await _read_bounded(r))
        out.request_id = body.get("id")
        out.first_token_at = out.ended_at = trio.current_time()
        usage = body.get("usage") or {}
        out.tokens = int(usage.get("completion_tokens", 0))
        out.kind = "completed"

    async def _stream(self, r: httpx.Response, spec: RequestSpec, out: Outcome) -> None:
        drop_after = spec.drop.after_events if spec.drop is not None else None
        if drop_after == 0:
            out.kind = "dropped"
            return
        out.kind = "truncated"  # until [DONE] says otherwise
        events = 0
        last: float | None = None
        async for event in SSEReader(r.aiter_lines()):
            now = trio.current_time()
            if event.done:
                out.kind = "error_event" if out.code is not None else "completed"
                out.ended_at = now
                return
            out.request_id = out.request_id or event.request_id
            if event.error is not None:
                out.code = str(event.error.get("code"))
                out.shape_ok = out.shape_ok and set(event.error) == ERROR_KEYS
            elif event.has_content:
                out.tokens += 1
                out.first_token_at = out.first_token_at or now
                if last is not None:
                    out.gaps.append(now - last)
                last = now
                self.streaming.add(out.index)
                if len(self.streaming) % 4 == 0 or out.tokens == 1:
                    self._notify()
            events += 1
            if drop_after is not None and events >= drop_after:
                out.kind = "dropped"
                return
            if spec.read_pause_s:
                await trio.sleep(spec.read_pause_s)


async def _read_bounded(r: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in r.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ERROR_BODY:
            break
    return b"".join(chunks)


def tally(outcomes: Sequence[Outcome]) -> dict[str, int]:
    counts = Counter(o.kind for o in outcomes)
    return dict(sorted(counts.items()))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]
