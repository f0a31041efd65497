"""A client that stops reading costs the gateway a bounded amount: its stream is cut past MAX_PENDING_BYTES of
untaken output, or when all streams together pass the gateway's PendingBudget, its KV freed on the worker (an
Abort) and every token its worker generated billed, while a client that keeps reading is never cut."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from gateway.config import AdmissionConfig, TimingConfig
from gateway.pipeline.admission import RequestAccount
from gateway.pipeline.choices import Choices
from gateway.pipeline.generation import OutputAssembler
from gateway.base.handle import (CUTTABLE_BYTES, MAX_PENDING_BYTES, PendingBudget, RequestFailed, RequestHandle,
                                     output_bytes)
from gateway.fleet.pool import WorkerPool
from gateway.pipeline.streaming import failure_to_api_error
from ipc.messages import PROTOCOL_VERSION, Hello, RequestOutputMsg, StepOutputs
from tests.test_gateway_units import _FakeTok

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


@pytest.mark.trio
async def test_all_streams_together_stay_under_the_gateway_bound() -> None:
    """1,000 stalled streams under 1 MiB each would hold 1 GiB: the gateway's budget cuts streams instead, the
    ones holding the most first to pass CUTTABLE_BYTES, while a stream whose client reads is never cut."""
    budget = PendingBudget(limit=8 << 20)
    stalled = [RequestHandle(f"s{i}", "w0", 3, budget=budget) for i in range(1000)]
    reading = RequestHandle("reading", "w0", 3, budget=budget)
    per = output_bytes(_out("x", 1))
    worst = 0
    for step in range(200):  # 200 x 2.7 KB a stream: 540 MB in all without the budget
        for h in stalled:
            h.push(_out(h.request_id, step))
        reading.push(_out("reading", step))
        await reading.next_outputs()
        worst = max(worst, budget.total)
        assert budget.total == sum(h.pending_bytes() for h in stalled) + reading.pending_bytes()
    assert worst <= budget.limit + 1000 * CUTTABLE_BYTES + per  # the stated bound
    cut = [h for h in stalled if h.overflowed]
    assert len(cut) == budget.cuts and 900 <= len(cut) < 1000  # most were cut; the survivors hold little
    assert not reading.overflowed and all(h.num_pending() == 0 for h in cut)
    for h in stalled:
        h.close()
    assert budget.total == 0  # closing a handle gives its bytes back


class _Sink:
    """Stands in for the ledger, the quota gate, the metrics and the trace of a RequestAccount."""

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.settled: list[int] = []

    def record_nowait(self, row: Any) -> None:
        self.rows.append(row)

    def settle(self, request_id: str, used: int) -> None:
        self.settled.append(used)

    def request_finished(self, *args: Any) -> None:
        pass

    def tier_finished(self, *args: Any) -> None:
        pass

    def admitted(self, *args: Any) -> None:
        pass

    def request_ended(self, *args: Any) -> None:
        pass


@pytest.mark.trio
async def test_a_cut_stream_is_billed_for_every_token_its_worker_generated() -> None:
    """Before, a request cut for a slow reader was billed for the tokens its client took (none here), though
    its worker had generated and the gateway had dropped many more."""
    h = RequestHandle("r", "w0", 3, max_pending_bytes=16 * 1024)
    pushed = 0
    while not h.overflowed:
        h.push(_out("r", pushed))
        pushed += 1
    asm = OutputAssembler(_FakeTok(), (), False)  # type: ignore[arg-type]
    choices = Choices.single(_Sink(), h, asm)  # type: ignore[arg-type]
    assert choices.completion_tokens == 0 and choices.generated_tokens == pushed
    sink = _Sink()
    who: Any = SimpleNamespace(tenant_id="t", key_id="k", tenant_name="t", log_text=False, tier="standard")
    account = RequestAccount(sink, sink, sink, who, "r", "m", 3, sink, True)  # type: ignore[arg-type]
    account.worker = "w0"
    account.end(choices, "client_too_slow")
    [row] = sink.rows
    assert row.completion_tokens == pushed and sink.settled == [3 + pushed]
