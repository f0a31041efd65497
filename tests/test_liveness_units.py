"""Units of the liveness work: per-worker senders, the step-sizing fit, a stream producer's bug contained,
and the worker's I/O thread heartbeating while its engine thread is busy."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import zmq

from gateway.pipeline.choices import Choices
from gateway.pipeline.generation import Delta
from gateway.base.handle import RequestHandle
from gateway.pipeline.streaming import DONE, StreamProducer
from gateway.fleet.worker_link import coalesce, open_outbox, run_sender
from ipc.codec import decode
from ipc.messages import PROTOCOL_VERSION, Abort, Generate, Hello, RequestOutputMsg, Stats
from ipc.sampling import SamplingParams
from ipc.transport import gateway_router, worker_dealer
from workers.process import step_sizing
from workers.process.worker_io import WorkerIO


def _gen(rid: str) -> Generate:
    return Generate(rid, [1, 2, 3], SamplingParams(), None, 1.0, None, None)


def test_coalesce_keeps_generates_in_order_and_sends_aborts_last_once() -> None:
    batch = [_gen("a"), Abort(["a"]), _gen("b"), Abort(["x", "a"]), Abort(["b"])]
    assert coalesce(batch) == [_gen("a"), _gen("b"), Abort(["a", "x", "b"])]
    assert coalesce([_gen("a")]) == [_gen("a")]


@pytest.mark.trio
async def test_a_worker_that_stops_reading_stalls_only_its_own_sender() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    router, addr = gateway_router(ctx, "tcp://127.0.0.1:*", sndhwm=2)
    stuck = worker_dealer(ctx, addr, "stuck", rcvhwm=2)  # never reads
    live = worker_dealer(ctx, addr, "live")
    failures: list[str] = []
    try:
        for d in (stuck, live):  # the router learns an identity from the peer's first frame
            d.send(b"\x90")
        with trio.fail_after(5):
            for _ in range(2):
                await router.recv_multipart()
        async with trio.open_nursery() as nursery:
            stuck_tx, stuck_rx = open_outbox()
            live_tx, live_rx = open_outbox()
            for d, rx in ((stuck, stuck_rx), (live, live_rx)):
                nursery.start_soon(run_sender, router, d.getsockopt(zmq.ROUTING_ID), rx, 2.0, failures.append)
            # ~5 MB a frame: a few fill the loopback TCP buffers even at their largest (smaller frames keep
            # trickling through as the kernel grows its windows, which is a slow pipe, not a stuck one).
            big = list(range(100_000, 1_100_000))
            for i in range(20):
                stuck_tx.send_nowait(Generate(f"s{i}", big, SamplingParams(), None, 1.0, None, None))
            await trio.sleep(0.2)
            live_tx.send_nowait(_gen("l0"))
            with trio.fail_after(1.0):  # arrives while the stuck sender still retries
                while not live.poll(0):
                    await trio.sleep(0.01)
            assert decode(live.recv()) == _gen("l0")
            assert not failures
            with trio.fail_after(5):  # the stuck sender gives up after its send timeout, alone
                while not failures:
                    await trio.sleep(0.05)
            live_tx.close()
        assert failures == ["send failed: its pipe stayed full for 2s"]
    finally:
        router.close()
        stuck.close(linger=0)
        live.close(linger=0)
        ctx.term()


def test_step_budget_follows_the_measured_prefill_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.tiny import hf_model, tiny_engine

    engine = tiny_engine(hf_model(), max_num_batched_tokens=64, max_num_seqs=8)
    # 10 ms per step plus 1 ms per prompt token: a 500 ms step prefills 490 tokens, plus 8 decodes.
    monkeypatch.setattr(step_sizing, "_prefill_ms", lambda eng, n, tag: 10.0 + 1.0 * n)
    sizing, _ = step_sizing.measure(engine, 500.0, max_num_seqs=8)
    assert (sizing.max_num_batched_tokens, round(sizing.fixed_ms, 6), round(sizing.per_token_ms, 6)) == (498, 10, 1)
    # A machine so slow that the target holds 20 prefill tokens: every running request still decodes and
    # prefill still advances by the minimum chunk.
    monkeypatch.setattr(step_sizing, "_prefill_ms", lambda eng, n, tag: 100.0 + 20.0 * n)
    assert step_sizing.measure(engine, 500.0, max_num_seqs=8)[0].max_num_batched_tokens == 8 + 32
    assert step_sizing.measure(engine, 500.0, max_num_seqs=64)[0].max_num_batched_tokens == 64 + 32
    monkeypatch.setattr(step_sizing, "_prefill_ms", lambda eng, n, tag: 0.001 * n)  # a huge machine
    assert step_sizing.measure(engine, 500.0, max_num_seqs=8)[0].max_num_batched_tokens == step_sizing.CEILING
    step_sizing.apply(engine, 20)
    assert engine.scheduler.config.max_num_batched_tokens == 20


def test_step_sizing_runs_real_probes_and_leaves_nothing_behind() -> None:
    from tests.tiny import hf_model, tiny_engine

    engine = tiny_engine(hf_model(), max_num_batched_tokens=64, max_num_seqs=8)
    sizing, _ = step_sizing.measure(engine, 500.0, max_num_seqs=8)
    assert 8 <= sizing.max_num_batched_tokens <= step_sizing.CEILING and sizing.per_token_ms > 0
    stats = engine.stats()
    assert not engine.has_unfinished() and stats.prompt_tokens_total == 0 and stats.num_running == 0


class _Asm:
    def __init__(self, bad: bool) -> None:
        self.bad, self.finished = bad, False

    def add(self, out: RequestOutputMsg) -> Delta:
        if self.bad:
            raise RuntimeError("a bug in one stream")
        self.finished = out.finish_reason is not None
        return Delta("x", list(out.new_token_ids), None, out.finish_reason)


class _Builder:
    req = SimpleNamespace(include_usage=False)

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        return None

    def delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        return [{"choices": [{"text": d.text, "finish_reason": d.finish_reason}]}]


class _Pool:
    def release(self, handle: RequestHandle) -> None:
        handle.released = True


class _Account:
    def __init__(self) -> None:
        self.ended: list[str] = []

    async def finish(self, asm: Any) -> None:
        pass

    def end(self, asm: Any, status: str) -> None:
        self.ended.append(status)


@pytest.mark.trio
async def test_a_producer_that_raises_ends_only_its_own_stream() -> None:
    producers = []
    for rid, bad in (("bad", True), ("good", False)):
        h = RequestHandle(rid, "w0", 3)
        h.push(RequestOutputMsg(rid, [5], "length", 0, None, None, None))
        fakes: Any = (_Pool(), _Asm(bad), _Builder())
        pool, asm, builder = fakes
        producers.append(StreamProducer(Choices.single(pool, h, asm), builder, None, 10.0, 60.0, _Account()))
    events: dict[str, list[str]] = {}
    async with trio.open_nursery() as nursery:  # stands for the app-wide nursery: it must not be cancelled
        for p in producers:
            nursery.start_soon(p.run)
        for p in producers:
            with trio.fail_after(5):
                events[p.choices.request_id] = [e async for e in p.events]
    bad, good = events["bad"], events["good"]
    assert bad[-1] == DONE and json.loads(bad[-2][6:])["error"]["code"] == "internal_error"
    assert good[-1] == DONE and json.loads(good[0][6:])["choices"][0]["finish_reason"] == "length"
    assert producers[0].account.ended == ["internal_error"]  # type: ignore[attr-defined]
    assert producers[1].account.ended == ["cancelled"]  # type: ignore[attr-defined]  # _Account.finish is a no-op


@pytest.mark.trio
async def test_a_stream_whose_client_takes_nothing_is_dropped_after_the_stall_timeout(autojump_clock: Any) -> None:
    h = RequestHandle("stalled", "w0", 3)
    for _ in range(40):  # more events than the producer's buffer holds: with no reader its put blocks
        h.push(RequestOutputMsg("stalled", [5], None, 0, None, None, None))
    fakes: Any = (_Pool(), _Asm(False), _Builder())
    pool, asm, builder = fakes
    p = StreamProducer(Choices.single(pool, h, asm), builder, None, 10.0, 7.0, _Account())
    start = trio.current_time()
    with trio.fail_after(600):
        await p.run()  # nobody iterates p.events
    assert 7.0 <= trio.current_time() - start < 8.0  # the configured stall timeout, not the 60 s default
    assert h.released and p.account.ended == ["cancelled"]  # type: ignore[attr-defined]


def test_serve_takes_the_stall_timeout() -> None:
    import argparse

    from gateway.cli import add_serve_parser, config_from_args

    root = argparse.ArgumentParser()
    add_serve_parser(root.add_subparsers())
    assert config_from_args(root.parse_args(["serve"])).timing.stream_stall_timeout == 60.0
    assert config_from_args(root.parse_args(["serve", "--stream-stall-timeout", "7"])).timing.stream_stall_timeout == 7
    with pytest.raises(ValueError, match="stream_stall_timeout"):
        config_from_args(root.parse_args(["serve", "--stream-stall-timeout", "0"]))


def test_io_thread_heartbeats_while_the_engine_thread_holds_the_gil() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = worker_dealer(ctx, f"tcp://127.0.0.1:{port}", "w0")
    hello = Hello(PROTOCOL_VERSION, "w0", 1, "tiny", 64, 16, 4, 100, [2], 8, 64)
    io = WorkerIO(ctx, dealer, hello, None, stats_interval=0.1)
    try:
        io.start()
        io.clock.begin()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # a pure-Python step: the GIL is only given up at switch intervals
            pass
        beats = []
        while router.poll(0):
            msg = decode(router.recv_multipart()[1])
            if isinstance(msg, Stats):
                beats.append(msg)
        assert len(beats) >= 5, f"only {len(beats)} heartbeats during a 1.5 s step"
        assert beats[-1].step_elapsed is not None and beats[-1].step_elapsed > 1.0 and beats[-1].steps_done == 0
        io.clock.end()
    finally:
        io.close()
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
