"""SSE keeps the connection alive with ``: ping`` comments while a request waits, and stops once it is
done. Driven on Trio's autojump clock, so the timing is exact and the test takes no wall time."""

from __future__ import annotations

import pytest
import trio

from gateway.base.handle import RequestHandle
from gateway.pipeline.generation import Delta, OutputAssembler
from gateway.pipeline.streaming import follow
from tests.test_gateway_units import _FakeTok, _out


@pytest.mark.trio
async def test_pings_while_waiting_then_stream_finishes(autojump_clock: trio.abc.Clock) -> None:
    handle = RequestHandle("r", "w0", prompt_len=3)
    asm = OutputAssembler(_FakeTok(), (), False)  # type: ignore[arg-type]
    pings: list[float] = []
    texts: list[str] = []

    async def ping() -> None:
        pings.append(trio.current_time())

    async def emit(d: Delta) -> None:
        texts.append(d.text)

    async def worker() -> None:
        await trio.sleep(3.5)  # a long queue or prefill: nothing for 3.5 s
        handle.push(_out("hi"))
        await trio.sleep(0.1)
        handle.push(_out("!", finish="stop"))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        await follow(handle, asm, emit, ping, ping_interval=1.0)
    assert [round(t - start, 3) for t in pings] == [1.0, 2.0, 3.0]  # one per idle interval, none after
    assert "".join(texts) == "hi!" and asm.finish_reason == "stop"


@pytest.mark.trio
@pytest.mark.parametrize(("code", "status"), [(None, 400), ("context_length_exceeded", 400),
                                              ("invalid_request", 400), ("grammar_busy", 503)])
async def test_a_request_the_worker_refused_fails_with_the_workers_error_code(code: str | None, status: int) -> None:
    """The worker says which error a request that could never run is (protocol 7); a worker of before sends none,
    which was always a prompt too long. A grammar it cannot compile is the client's 400, not a context-length one;
    no compile slot in time is a 503 to retry."""
    from gateway.base.handle import RequestFailed
    from gateway.pipeline.streaming import failure_to_api_error
    from ipc.messages import RequestOutputMsg

    handle = RequestHandle("r", "w0", prompt_len=3)
    asm = OutputAssembler(_FakeTok(), (), False)  # type: ignore[arg-type]
    handle.push(RequestOutputMsg("r", [], "length", 0, None, "why it could not run", None, code))

    async def emit(d: Delta) -> None:
        raise AssertionError("nothing may be emitted for a refused request")

    with pytest.raises(RequestFailed) as failed:
        await follow(handle, asm, emit)
    err = failure_to_api_error(failed.value)
    assert (err.status, err.code, err.message) == (status, code or "context_length_exceeded", "why it could not run")
