"""Draining one worker, in process (issue 14 item 5): a draining worker gets no new request from the moment of the
drain, its Drain leaves after every Generate queued before it, it finishes what it holds and its Goodbye fails
nothing; draining the only worker answers 503 no_worker; past the drain timeout its requests fail with
drain_timeout and it is told to shut down; kvgatectl's rolling restart drains the next worker only once the last
one's fresh process is listed. Driven on Trio's autojump clock (and a fake admin API): no machine speed."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed
from gateway.config import AdmissionConfig, TimingConfig
from gateway.fleet.pool import WorkerPool
from gateway.fleet.worker_link import Outgoing, coalesce
from gateway.pipeline.streaming import failure_to_api_error
from ipc.messages import (PROTOCOL_VERSION, Abort, Drain, Generate, Goodbye, Hello, RequestOutputMsg, Shutdown,
                          StepOutputs)
from ipc.sampling import SamplingParams


def _pool(n: int) -> tuple[WorkerPool, dict[str, trio.MemoryReceiveChannel[Outgoing]]]:
    """A pool with ``n`` workers (w0, w1, ...; pids 100, 101, ...) whose outboxes the test reads."""
    sock: Any = None  # never touched: no sender tasks run, the test reads the outboxes itself
    pool = WorkerPool(sock, "m", TimingConfig(), AdmissionConfig())
    boxes = {}
    for i in range(n):
        wid = f"w{i}"
        pool._on_hello(wid.encode(), Hello(PROTOCOL_VERSION, wid, 100 + i, "m", 4096, 16, 256, 100, [0], 8, 256))
        tx, rx = trio.open_memory_channel[Outgoing](100)
        pool.workers[wid].outbox = tx
        boxes[wid] = rx
    return pool, boxes


def _sent(rx: trio.MemoryReceiveChannel[Outgoing]) -> list[Outgoing]:
    out = []
    while True:
        try:
            out.append(rx.receive_nowait())
        except trio.WouldBlock:
            return out


async def _submit(pool: WorkerPool, rid: str) -> Any:
    return await pool.submit(rid, [1, 2, 3], SamplingParams(), None, None)


def _finish(rid: str) -> RequestOutputMsg:
    return RequestOutputMsg(rid, [7], "length", 0, None, None, None)


@pytest.mark.trio
async def test_a_draining_worker_gets_nothing_new_and_finishes_what_it_holds(autojump_clock: trio.abc.Clock) -> None:
    pool, boxes = _pool(2)
    async with trio.open_nursery() as nursery:
        pool._nursery = nursery  # runs the drain's task
        held = await _submit(pool, "held")
        assert held.worker_id == "w0"  # a tie goes to the first id
        w0 = pool.drain("w0", timeout=60)
        assert pool.drain("w0", timeout=60) is w0 and w0.draining  # idempotent
        after = [await _submit(pool, f"r{i}") for i in range(8)]
        assert {h.worker_id for h in after} == {"w1"}  # nothing new to the draining worker
        assert pool.ready  # w1 still takes requests
        await trio.sleep(0.1)  # the drain task queues Drain
        sent = _sent(boxes["w0"])
        assert [type(m) for m in sent] == [Generate, Drain] and isinstance(sent[0], Generate)
        assert sent[0].request_id == "held"  # the Generate queued before the drain goes first
        # The worker finishes its request, then says goodbye: nothing fails, the pid is known as drained.
        pool._on_step(w0, StepOutputs([_finish("held")], 1))
        pool._on_message(b"w0", Goodbye("w0", "drained"))
        assert "w0" not in pool.workers and w0.gone.is_set()
        assert pool.losses["drained"] == 1 and pool.losses["goodbye"] == 0
        assert pool.drained(100) and not pool.drained(101)
        outs = await held.next_outputs()
        assert outs[-1].finish_reason == "length"
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_draining_the_only_worker_answers_503_no_worker_until_a_fresh_one_says_hello(
        autojump_clock: trio.abc.Clock) -> None:
    pool, _ = _pool(1)
    pool.drain("w0", timeout=60)
    assert not pool.ready  # /ready turns false: a load balancer sends its traffic to another gateway
    with pytest.raises(APIError) as refused:
        await _submit(pool, "r")
    assert refused.value.status == 503 and refused.value.code == "no_worker"
    assert "retry-after" in refused.value.headers()
    with pytest.raises(KeyError):
        pool.drain("w9", timeout=1)
    pool._on_message(b"w0", Goodbye("w0", "drained"))
    pool._on_hello(b"w0", Hello(PROTOCOL_VERSION, "w0", 200, "m", 4096, 16, 256, 100, [0], 8, 256))  # fresh one
    assert pool.ready and not pool.workers["w0"].draining
    assert (await _submit(pool, "r2")).worker_id == "w0"


@pytest.mark.trio
async def test_past_the_drain_timeout_its_requests_fail_with_drain_timeout_and_it_is_shut_down(
        autojump_clock: trio.abc.Clock) -> None:
    pool, boxes = _pool(2)
    killed: list[tuple[str, int]] = []
    pool.kill_local = lambda wid, pid: killed.append((wid, pid)) is None
    async with trio.open_nursery() as nursery:
        pool._nursery = nursery
        held = await _submit(pool, "held")
        pool.drain("w0", timeout=5)
        await trio.sleep(4)
        assert [type(m) for m in _sent(boxes["w0"])] == [Generate, Drain] and not held.has_pending()
        await trio.sleep(2)  # past the timeout
        assert [type(m) for m in _sent(boxes["w0"])] == [Shutdown]
        with pytest.raises(RequestFailed) as failed:
            await held.next_outputs()
        assert failed.value.code == "drain_timeout"
        err = failure_to_api_error(failed.value)
        assert err.status == 503 and err.code == "drain_timeout"
        assert not killed  # it still has its grace to exit after the Shutdown...
        await trio.sleep(60)
        assert killed == [("w0", 100)]  # ...and is killed when it does not
        nursery.cancel_scope.cancel()


def test_control_messages_leave_after_the_batchs_generates_and_aborts() -> None:
    gen = Generate("a", [1], SamplingParams(), None, 1.0, None, None)
    gen_b = Generate("b", [1], SamplingParams(), None, 1.0, None, None)
    assert coalesce([gen, Drain(), Abort(["x"]), gen_b]) == [gen, gen_b, Abort(["x"]), Drain()]
    assert coalesce([Shutdown()]) == [Shutdown()]


class _FakeGateway:
    """The /admin/workers API of a gateway whose drained worker is away for two polls, then back with a new pid."""

    def __init__(self) -> None:
        self.pids = {"w0": 100, "w1": 101}
        self.away: dict[str, int] = {}  # worker id -> polls left until its fresh process is listed
        self.events: list[str] = []

    def drain_worker(self, worker_id: str, timeout: float | None) -> dict[str, Any]:
        assert not self.away, "a drain began while another worker was still away"
        self.events.append(f"drain {worker_id}")
        self.away[worker_id] = 2
        return {"worker": worker_id, "pid": self.pids[worker_id], "state": "draining", "in_flight": 3,
                "timeout": 30.0 if timeout is None else timeout}

    def workers(self) -> dict[str, Any]:
        for wid in list(self.away):
            self.away[wid] -= 1
            if self.away[wid] < 0:
                del self.away[wid]
                self.pids[wid] += 1000
                self.events.append(f"back {wid}")
        rows = [{"worker": w, "state": "ready", "hello": {"pid": p}} for w, p in self.pids.items() if w not in self.away]
        return {"object": "list", "data": rows}


def test_rolling_restart_drains_the_next_worker_only_after_the_last_is_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from console import worker_cli

    monkeypatch.setattr(worker_cli, "POLL_S", 0.0)
    gw = _FakeGateway()
    lines: list[str] = []
    results = worker_cli.roll(gw, ["w0", "w1"], None, 60.0, lines.append)  # type: ignore[arg-type]
    assert gw.events == ["drain w0", "back w0", "drain w1", "back w1"]
    assert [(r["worker"], r["old_pid"], r["new_pid"]) for r in results] == [("w0", 100, 1100), ("w1", 101, 1101)]
    assert len(lines) == 4 and lines[0].startswith("w0: draining (pid 100")
