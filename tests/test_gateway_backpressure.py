"""A client that stops reading costs the gateway a bounded amount: its stream is cut past MAX_PENDING_BYTES of
untaken output, its KV freed on the worker (an Abort), while a client that keeps reading is never cut."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from gateway.config import AdmissionConfig, TimingConfig
from gateway.pipeline.handle import MAX_PENDING_BYTES, RequestFailed, RequestHandle, output_bytes
from gateway.fleet.pool import WorkerPool
from gateway.pipeline.streaming import failure_to_api_error
from ipc.messages import PROTOCOL_VERSION, Hello, RequestOutputMsg, StepOutputs

LOGPROBS = 20


def _out(rid: str, token: int, finish: str | None = None, logprobs: int = LOGPROBS) -> RequestOutputMsg:
    lps = [(-0.5, [(t, -1.0 - t / 100) for t in range(logprobs)])] if logprobs else None
    return RequestOutputMsg(rid, [token], finish, 0, lps, None, None)


@pytest.mark.trio
async def test_a_handle_nobody_reads_is_cut_at_its_byte_bound_and_drops_its_backlog() -> None:
    h = RequestHandle("r", "w0", 3, max_pending_bytes=64 * 1024)
    per = output_bytes(_out("r", 1))
    pushed = 0
    while not h.overflowed and pushed < 10_000:
        h.push(_out("r", pushed))
        pushed += 1
    assert h.overflowed
    assert pushed == 64 * 1024 // per + 1  # cut on the first output that would pass the bound, not later
    assert h.num_pending() == 0 and h.pending_bytes() == 0  # the backlog is dropped at once, not at the 60 s cut
    h.push(_out("r", 1))  # late outputs are ignored, never queued again
    assert h.num_pending() == 0


@pytest.mark.trio
async def test_the_cut_request_ends_its_reader_with_client_too_slow() -> None:
    h = RequestHandle("r", "w0", 3, max_pending_bytes=16 * 1024)
    for i in range(100):
        h.push(_out("r", i))
    with pytest.raises(RequestFailed) as e:
        with trio.fail_after(1):
            await h.next_outputs()
    assert e.value.code == "client_too_slow"
    err = failure_to_api_error(e.value)
    assert err.status == 408 and err.body()["error"]["code"] == "client_too_slow"


@pytest.mark.trio
async def test_a_reader_that_keeps_up_is_never_cut_and_the_finish_always_lands() -> None:
    h = RequestHandle("r", "w0", 3, max_pending_bytes=16 * 1024)
    taken: list[int] = []
    for i in range(5_000):  # 10x the bound in total, read in batches well under it
        h.push(_out("r", i))
        if i % 4 == 3:
            taken += [t for o in await h.next_outputs() for t in o.new_token_ids]
        assert h.pending_bytes() <= 16 * 1024
    h.push(_out("r", 5_000, finish="length"))  # a finish is queued even at the bound: it frees nothing more
    while not taken or taken[-1] != 5_000:
        taken += [t for o in await h.next_outputs() for t in o.new_token_ids]
    assert not h.overflowed and h.finished and taken == list(range(5_001))


@pytest.mark.trio
async def test_the_pool_aborts_a_stalled_stream_on_its_worker_and_keeps_the_others() -> None:
    sock: Any = None  # the pool never touches its socket here: no nursery runs its senders
    pool = WorkerPool(sock, "m", TimingConfig(), AdmissionConfig())
    pool._on_hello(b"w0", Hello(PROTOCOL_VERSION, "w0", 4242, "m", 4096, 16, 256, 100, [0], 8, 256))
    w = pool.workers["w0"]
    stalled = await pool.submit("stalled", [1, 2, 3], {}, None, None)
    reading = await pool.submit("reading", [1, 2, 3], {}, None, None)
    steps = 2 * MAX_PENDING_BYTES // output_bytes(_out("x", 1))
    for i in range(steps):  # twice what the stalled stream may hold
        pool._on_step(w, StepOutputs([_out("stalled", i), _out("reading", i)], 2))
        await reading.next_outputs()
    assert stalled.overflowed and stalled.released
    assert "stalled" not in w.requests and "stalled" in w.aborting  # an Abort is queued: its KV is freed
    assert stalled.num_pending() == 0
    assert "reading" in w.requests and not reading.overflowed and "reading" not in w.aborting
    assert pool.num_inflight == 1
    pool.release(stalled)  # the stream's own finally releases it again: a no-op
    assert pool.num_inflight == 1
