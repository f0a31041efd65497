"""Drill 6: fifty SSE clients that read a few bytes a second, beside a few normal ones.

Each slow reader is a raw socket with a small receive buffer that takes 4 bytes a second, so its stream backs up
through TCP into the gateway. Verdict: the gateway's memory stays bounded; the normal clients' inter-token latency
is not held back (compared with the same load read at full speed, so the extra sequences in the batch are not
counted against it); and the stalled streams are cut (the gateway's consumer-stall timeout) and their KV freed.
"""

from __future__ import annotations

import json
import socket
from typing import ClassVar
from urllib.parse import urlsplit

import trio

from chaos.deployment import DeploymentSpec
from chaos.drills.base import Drill, DrillContext, Sizing, prompt_ids, quiet_checks, record_outcomes
from chaos.drills.streams import COMPLETIONS, long_streams
from chaos.load import Outcome, RequestSpec, percentile
from chaos.metrics import MetricsWatch, scrape, wait_quiet
from chaos.procs import RssWatch
from chaos.rawhttp import build
from chaos.verdict import Check, DrillResult, at_most, check

SLOW_READERS = 50
NORMAL = 4
READ_BYTES, READ_EVERY_S = 4, 1.0
RCVBUF = 2048  # the kernel doubles it; small, so backpressure reaches the gateway within seconds
LOGPROBS = 20  # 20 alternatives per token make each event about 1.5 KB: the socket buffers fill in a few dozen tokens
# The gateway's --stream-stall-timeout: its default at full size; quick, 5 s, so CI does not wait a minute for it
# (a normal client empties its 16-event buffer within milliseconds; a slow reader never, at 4 bytes a second).
STALL_S: dict[bool, float] = {True: 5.0, False: 60.0}
# That timeout after the buffers fill, with room to spare (smollm2 fills them slower).
CUT_WITHIN_S: dict[bool, float] = {True: 180.0, False: 400.0}
# What a stalled stream may cost the gateway: its 16-event SSE buffer and socket buffers need well under 1 MiB.
GATEWAY_MIB_PER_READER = 2.0
CANCELLED = "kvgate:client_cancellations_total"
PENDING = "kvgate:ipc_pending_outputs"


async def slow_reader(host: str, port: int, request: bytes, stop: trio.Event) -> int:
    """Send ``request`` and read it READ_BYTES at a time every READ_EVERY_S until ``stop``; returns bytes read."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    got = 0
    with sock:
        with trio.fail_after(30):
            await sock.connect((host, port))
            await sock.send(request)
        while not stop.is_set():
            with trio.move_on_after(READ_EVERY_S):
                await stop.wait()
            chunk = await sock.recv(READ_BYTES)
            if not chunk:
                break
            got += len(chunk)
    return got


class SlowReaders(Drill):
    name = "slow-readers"
    summary = ("50 SSE clients that read a few bytes a second: gateway memory stays bounded, other clients' "
               "inter-token latency is not held back, stalled streams are cut and their KV freed")
    time_limit_s: ClassVar[tuple[float, float]] = (400.0, 1200.0)

    def spec(self, sizing: Sizing) -> DeploymentSpec:
        return DeploymentSpec(sizing.model_dir, serve_args=("--max-num-seqs", "64", "--kv-cache-tokens", "131072",
                                                            "--stream-stall-timeout", f"{STALL_S[sizing.quick]:g}"),
                              torch_threads=1 if sizing.quick else None)

    def _reader_body(self, ctx: DrillContext, max_tokens: int) -> bytes:
        body = json.dumps(ctx.completion(prompt_ids(ctx.rng, 16), max_tokens, logprobs=LOGPROBS)).encode()
        return build("POST", COMPLETIONS, body, [(b"Authorization", f"Bearer {ctx.target.api_key}".encode()),
                                                 (b"Content-Type", b"application/json")])

    async def run(self, ctx: DrillContext, result: DrillResult) -> None:
        reader_tokens, normal_tokens = (2000, 100) if ctx.sizing.model == "tiny" else (1024, 32)
        result.load = (f"{NORMAL} normal streams ({normal_tokens} tokens) beside {SLOW_READERS} streams of "
                       f"{reader_tokens} tokens with logprobs {LOGPROBS}, first read at full speed (baseline), then "
                       f"by clients reading {READ_BYTES} bytes every {READ_EVERY_S:g}s (receive buffer {RCVBUF} B)")
        fast = [RequestSpec(COMPLETIONS, ctx.completion(prompt_ids(ctx.rng, 16), reader_tokens, logprobs=LOGPROBS),
                            600.0) for _ in range(SLOW_READERS)]
        baseline = await self._normal_beside(ctx, normal_tokens, fast_specs=fast)
        await wait_quiet(ctx.client, ctx.target.url, 60.0)  # the baseline's readers are all gone and counted
        before = await scrape(ctx.client, ctx.target.url)
        watch = RssWatch({"gateway": ctx.gateway_pid}) if ctx.gateway_pid else None
        backlog = MetricsWatch(ctx.client, ctx.target.url, (PENDING,), interval=1.0)
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            nursery.start_soon(backlog.run)
            if watch is not None:
                nursery.start_soon(watch.run)
            parts = urlsplit(ctx.target.url)
            for _ in range(SLOW_READERS):
                nursery.start_soon(slow_reader, parts.hostname or "127.0.0.1", parts.port or 80,
                                   self._reader_body(ctx, reader_tokens), stop)
            await trio.sleep(1.0)  # the slow readers are admitted and streaming
            beside = await self._normal_beside(ctx, normal_tokens)
            cut_after = await self._wait_cut(ctx, before.total(CANCELLED), CUT_WITHIN_S[ctx.sizing.quick])
            stop.set()
            nursery.cancel_scope.cancel()
        record_outcomes(result, [*baseline, *beside])
        # Outputs the workers sent that no client has taken yet: what a stalled stream makes the gateway hold.
        result.measurements["peak_pending_outputs"] = int(backlog.peak[PENDING])
        result.add(*self._latency(result, baseline, beside))
        result.add(check(f"stalled streams cut within {CUT_WITHIN_S[ctx.sizing.quick]:g}s", cut_after is not None,
                         "never" if cut_after is None else f"all {SLOW_READERS} after {cut_after:.0f}s"))
        if watch is not None:
            result.add(at_most(f"gateway memory bounded (RSS growth <= {GATEWAY_MIB_PER_READER:g} MiB per slow reader)",
                               round(watch.growth_mib("gateway"), 1), GATEWAY_MIB_PER_READER * SLOW_READERS, " MiB"))
        result.add(*await quiet_checks(ctx, within=60.0))

    async def _normal_beside(self, ctx: DrillContext, tokens: int,
                             fast_specs: list[RequestSpec] | None = None) -> list[Outcome]:
        """NORMAL streams run to their end; with ``fast_specs``, beside those read at full speed (then dropped)."""
        normal = ctx.load(NORMAL)
        async with trio.open_nursery() as nursery:
            if fast_specs:
                readers = ctx.load(len(fast_specs))
                nursery.start_soon(readers.run, fast_specs)
                await readers.wait_streaming(len(fast_specs), 120.0)
            outcomes = await normal.run(long_streams(ctx, NORMAL, 16, tokens, 600.0))
            nursery.cancel_scope.cancel()  # the full-speed readers were only the baseline's company
        return outcomes

    async def _wait_cut(self, ctx: DrillContext, cancelled_before: float, within: float) -> float | None:
        """Seconds until the gateway has given up on every slow reader (its cancellations count them)."""
        start = trio.current_time()
        with trio.move_on_after(within):
            while (await scrape(ctx.client, ctx.target.url)).total(CANCELLED) - cancelled_before < SLOW_READERS:
                await trio.sleep(1.0)
            return trio.current_time() - start
        return None

    def _latency(self, result: DrillResult, baseline: list[Outcome], beside: list[Outcome]) -> list[Check]:
        def p(outcomes: list[Outcome], q: float) -> float:
            return percentile([g for o in outcomes for g in o.gaps], q) or 0.0

        for name, outs in (("baseline", baseline), ("beside_slow_readers", beside)):
            result.measurements[f"normal_itl_p50_{name}_s"] = round(p(outs, 50), 4)
            result.measurements[f"normal_itl_p99_{name}_s"] = round(p(outs, 99), 4)
        done = sum(1 for o in beside if o.kind == "completed")
        limit50, limit99 = 2 * p(baseline, 50) + 0.05, 2 * p(baseline, 99) + 0.25
        return [check("normal streams beside the slow readers all completed", done == NORMAL, f"{done}/{NORMAL}"),
                check("their inter-token latency not held back (p50 <= 2x baseline + 50 ms, p99 <= 2x + 250 ms)",
                      p(beside, 50) <= limit50 and p(beside, 99) <= limit99,
                      f"p50 {p(beside, 50) * 1000:.0f} ms (limit {limit50 * 1000:.0f}), p99 {p(beside, 99) * 1000:.0f}"
                      f" ms (limit {limit99 * 1000:.0f})")]
