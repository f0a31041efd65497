"""ipc.transport: a Trio ROUTER talking to DEALERs over real ZeroMQ sockets (127.0.0.1, ipc://, inproc://).

Every wait is bounded: trio.fail_after on the Trio side, a deadline in every blocking worker thread, and
pytest-timeout as a last resort. A hang here means the edge-triggered zmq.FD handling is wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
import zmq

from ipc.codec import encode
from ipc.messages import (
    PROTOCOL_VERSION,
    Abort,
    Drain,
    Generate,
    GatewayToWorker,
    Goodbye,
    Hello,
    RequestOutputMsg,
    Stats,
    StepOutputs,
)
from ipc.sampling import SamplingParams
from ipc.transport import (
    PeerUnreachable,
    TrioZmqSocket,
    drain_incoming,
    gateway_router,
    router_recv,
    router_send,
    send,
    worker_dealer,
)

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0  # seconds: generous bound for any single wait; a healthy run needs milliseconds
BURST = 10_000
WORKER = "worker-0"


def hello(worker_id: str = WORKER) -> Hello:
    return Hello(PROTOCOL_VERSION, worker_id, 4321, "tiny", 256, 16, 64, 512, [2], 8, 64)


def generate(i: int) -> Generate:
    return Generate(f"req-{i}", [1, 2, i], SamplingParams(temperature=0.0, max_tokens=4), None, 1.0, None, None)


def step(i: int) -> StepOutputs:
    return StepOutputs([RequestOutputMsg(f"req-{i}", [i], None, 0, None, None, None)], 1)


def stats(i: int) -> Stats:
    return Stats(WORKER, i, 0, 0.0, 64, 64, 0, 0, 0, 0, 0, float(i), i, None, [])


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["tcp", "ipc"])
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/gw.sock"


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run blocking worker code off the Trio thread; abandoned (not waited for) if the test times out."""
    return trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def recv_until(sock: zmq.Socket[bytes], want: int, deadline_s: float = WAIT) -> list[GatewayToWorker]:
    """Worker side: drain until ``want`` messages arrived (or fail at the deadline instead of hanging)."""
    deadline = time.monotonic() + deadline_s
    got: list[GatewayToWorker] = []
    while len(got) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker got {len(got)}/{want} messages")
        got.extend(drain_incoming(sock, timeout_ms=50))
    return got


# --------------------------------------------------------------------------------------------------
# conversation
# --------------------------------------------------------------------------------------------------


@pytest.mark.trio
async def test_router_and_worker_thread_converse(ctx: zmq.Context[Any], address: str) -> None:
    router, bound = gateway_router(ctx, address)
    assert "*" not in bound  # the wildcard port is resolved

    def worker() -> list[GatewayToWorker]:
        dealer = worker_dealer(ctx, bound, WORKER)
        try:
            send(dealer, hello(), timeout_ms=int(WAIT * 1000))
            got = recv_until(dealer, 1)
            send(dealer, step(1), timeout_ms=int(WAIT * 1000))
            got += recv_until(dealer, 1)
            send(dealer, Goodbye(WORKER, "done"), timeout_ms=int(WAIT * 1000))
            return got
        finally:
            dealer.close(linger=int(WAIT * 1000))  # LINGER 0 would race the queued Goodbye

    with router:
        async with trio.open_nursery() as nursery:
            results: list[list[GatewayToWorker]] = []

            async def run_worker() -> None:
                results.append(await in_thread(worker))

            nursery.start_soon(run_worker)
            with trio.fail_after(WAIT):
                identity, msg = await router_recv(router)
                assert msg == hello() and identity not in (WORKER.encode(), b"")  # a routing id of its own
                await router_send(router, identity, generate(1))
                assert await router_recv(router) == (identity, step(1))
                await router_send(router, identity, Abort(["req-1", "req-1"]))
                assert await router_recv(router) == (identity, Goodbye(WORKER, "done"))
        assert results == [[generate(1), Abort(["req-1", "req-1"])]]


# --------------------------------------------------------------------------------------------------
# bursts: the edge-triggered FD test
# --------------------------------------------------------------------------------------------------


def _worker_burst(ctx: zmq.Context[Any], addr: str, n: int, hwm: int, router_done: threading.Event) -> list[int]:
    """Blocking DEALER that sends n StepOutputs while receiving n Generates, interleaved, never blocking
    in one direction while the other could progress; closes only once the router says it has all n.
    Returns the received sequence numbers."""
    dealer = worker_dealer(ctx, addr, WORKER, sndhwm=hwm, rcvhwm=hwm)
    deadline = time.monotonic() + WAIT
    sent, received = 0, []
    try:
        send(dealer, hello(), timeout_ms=int(WAIT * 1000))
        while sent < n or len(received) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker sent {sent}/{n}, received {len(received)}/{n}")
            flags = zmq.POLLIN | (zmq.POLLOUT if sent < n else 0)
            ready = dealer.poll(50, flags)
            if ready & zmq.POLLOUT:
                try:
                    dealer.send(encode(step(sent)), flags=zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            for msg in drain_incoming(dealer, timeout_ms=0):
                assert isinstance(msg, Generate)
                received.append(msg.prompt_token_ids[-1])
        return received
    finally:
        # Close only after the router has everything. A linger does not make close safe: with the router's tiny
        # RCVHWM holding frames back, libzmq can drop the DEALER's last frames on close whatever the linger
        # (zeromq/libzmq#4660; reproduced here: ~1 run in 75 under CPU load lost the last 9-1,021 StepOutputs, the
        # router's monitor showing DISCONNECTED and EVENTS 0). Real peers end with an acknowledged exchange.
        router_done.wait(WAIT)
        dealer.close(linger=int(WAIT * 1000))


# Tiny HWMs force thousands of EAGAIN -> wait -> wake cycles on both directions. Huge HWMs mean sends never
# wait, so only re-reading EVENTS after each send wakes a receiver whose FD edge that send consumed.
HWMS = pytest.mark.parametrize("hwm", [5, 100_000], ids=["tiny-hwm", "no-backpressure"])


@HWMS
@pytest.mark.trio
async def test_burst_both_directions_with_worker_thread(ctx: zmq.Context[Any], hwm: int) -> None:
    router, bound = gateway_router(ctx, "tcp://127.0.0.1:*", sndhwm=hwm, rcvhwm=hwm)
    received: list[int] = []
    worker_received: list[list[int]] = []
    router_done = threading.Event()

    async def run_worker() -> None:
        worker_received.append(await in_thread(lambda: _worker_burst(ctx, bound, BURST, hwm, router_done)))

    async def gateway_send(identity: bytes) -> None:
        for i in range(BURST):
            await router_send(router, identity, generate(i))

    with router, trio.fail_after(WAIT * 2):
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_worker)
                identity, msg = await router_recv(router)
                assert msg == hello()
                nursery.start_soon(gateway_send, identity)  # sends while this task receives: same socket
                while len(received) < BURST:
                    _, out = await router_recv(router)
                    assert isinstance(out, StepOutputs)
                    received.append(int(out.outputs[0].request_id.removeprefix("req-")))
                router_done.set()  # the worker may close now
        finally:
            router_done.set()  # never leave the worker thread waiting past a failure
    assert received == list(range(BURST))  # nothing lost, nothing reordered
    assert worker_received == [list(range(BURST))]


@HWMS
@pytest.mark.trio
async def test_burst_trio_to_trio_inproc(ctx: zmq.Context[Any], hwm: int) -> None:
    """Both ends are TrioZmqSockets in one Trio run, each with a concurrent sender and receiver task."""
    router, bound = gateway_router(ctx, "inproc://gateway", sndhwm=hwm, rcvhwm=hwm)
    dealer = TrioZmqSocket(worker_dealer(ctx, bound, WORKER, sndhwm=hwm, rcvhwm=hwm))
    at_router: list[int] = []
    at_dealer: list[int] = []

    async def dealer_send() -> None:
        await dealer.send_multipart([encode(hello())])
        for i in range(BURST):
            await dealer.send_multipart([encode(stats(i))])

    async def dealer_recv() -> None:
        while len(at_dealer) < BURST:
            (payload,) = await dealer.recv_multipart()
            at_dealer.append(len(at_dealer))
            assert msgpack.unpackb(payload)[0] == msgpack.unpackb(encode(Abort([])))[0]

    async def router_side() -> None:
        identity, first = await router_recv(router)
        assert first == hello()

        async def send_all() -> None:
            for i in range(BURST):
                await router_send(router, identity, Abort([f"req-{i}"]))

        async with trio.open_nursery() as inner:
            inner.start_soon(send_all)
            while len(at_router) < BURST:
                _, msg = await router_recv(router)
                assert isinstance(msg, Stats)
                at_router.append(msg.running)

    with router, dealer, trio.fail_after(WAIT * 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dealer_send)
            nursery.start_soon(dealer_recv)
            nursery.start_soon(router_side)
    assert at_router == list(range(BURST)) and len(at_dealer) == BURST


@pytest.mark.trio
async def test_send_that_consumes_the_receivers_fd_edge_wakes_the_receiver(ctx: zmq.Context[Any]) -> None:
    """Deterministic version of the race the bursts hit by chance.

    The receiver parks on the router's FD. The worker's frame signals the FD, and in the same Trio batch
    (no checkpoint in between) the router's send processes libzmq's pending commands, which drains the FD
    before Trio polls it. POLLIN is now set but the FD will never fire again: only re-reading EVENTS after
    the send (and waking the receiver) lets it see the frame."""
    router, bound = gateway_router(ctx, "inproc://gw-edge")
    raw_dealer = worker_dealer(ctx, bound, WORKER)
    dealer = TrioZmqSocket(raw_dealer)
    received: list[tuple[bytes, object]] = []
    with router, dealer, trio.fail_after(WAIT):
        await dealer.send_multipart([encode(hello())])
        identity, _ = await router_recv(router)
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                received.append(await router_recv(router))

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()  # the receiver is parked on the FD
            await trio.sleep(0.01)  # past libzmq's ~1 ms throttle, so the next send processes commands
            raw_dealer.send(encode(stats(1)))  # signals the router's FD ...
            await router_send(router, identity, Drain())  # ... and this send drains it, same batch
    assert received == [(identity, stats(1))]


@pytest.mark.trio
async def test_many_producers_share_one_sender_task(ctx: zmq.Context[Any]) -> None:
    router, bound = gateway_router(ctx, "inproc://gw-producers", sndhwm=5, rcvhwm=5)
    dealer = TrioZmqSocket(worker_dealer(ctx, bound, WORKER, sndhwm=5, rcvhwm=5))
    producers, each = 20, 100
    got: list[bytes] = []
    with router, dealer, trio.fail_after(WAIT):
        await dealer.send_multipart([encode(hello())])
        identity, _ = await router_recv(router)
        send_channel, receive_channel = trio.open_memory_channel[list[bytes]](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router.send_all_from, receive_channel)

            async def produce(k: int, channel: trio.MemorySendChannel[list[bytes]]) -> None:
                async with channel:
                    for i in range(each):
                        await channel.send([identity, encode(Abort([f"{k}-{i}"]))])

            async with send_channel:
                for k in range(producers):
                    nursery.start_soon(produce, k, send_channel.clone())
            while len(got) < producers * each:
                (payload,) = await dealer.recv_multipart()
                got.append(payload)
    assert len(set(got)) == producers * each


# --------------------------------------------------------------------------------------------------
# bad frames, errors, cancellation
# --------------------------------------------------------------------------------------------------


@pytest.mark.trio
async def test_malformed_frames_to_router_are_dropped(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    router, bound = gateway_router(ctx, "tcp://127.0.0.1:*")

    def worker() -> None:
        dealer = worker_dealer(ctx, bound, WORKER)
        try:
            dealer.send(b"\xc1 definitely not msgpack")
            dealer.send(msgpack.packb([16, PROTOCOL_VERSION + 1, WORKER]))  # Hello of another version
            dealer.send(msgpack.packb([18, WORKER, True]))  # Stats, wrong arity and a bool
            dealer.send_multipart([encode(stats(0)), encode(stats(0))])  # two frames in one message
            send(dealer, generate(0))  # valid frame, wrong direction
            send(dealer, stats(7), timeout_ms=int(WAIT * 1000))
        finally:
            # LINGER is 0 on our sockets: closing at once could discard frames still queued locally.
            dealer.close(linger=int(WAIT * 1000))

    with router, caplog.at_level(logging.WARNING, logger="ipc"):
        await in_thread(worker)
        with trio.fail_after(WAIT):
            assert (await router_recv(router))[1] == stats(7)
    dropped = [r for r in caplog.records if "dropping" in r.getMessage()]
    assert len(dropped) == 5
    assert any("version mismatch" in r.getMessage() for r in dropped)


@pytest.mark.trio
async def test_malformed_frames_to_worker_are_dropped(ctx: zmq.Context[Any]) -> None:
    router, bound = gateway_router(ctx, "tcp://127.0.0.1:*")
    dealer = worker_dealer(ctx, bound, WORKER)
    with router:
        try:
            send(dealer, hello())
            with trio.fail_after(WAIT):
                identity, _ = await router_recv(router)
                await router.send_multipart([identity, b"junk"])
                await router.send_multipart([identity, encode(hello())])  # wrong direction
                await router.send_multipart([identity, encode(Drain()), b"extra part"])
                await router_send(router, identity, Abort(["req-9"]))
            assert await in_thread(lambda: recv_until(dealer, 1)) == [Abort(["req-9"])]
        finally:
            dealer.close()


@pytest.mark.trio
async def test_send_to_unknown_worker_raises(ctx: zmq.Context[Any]) -> None:
    router, _ = gateway_router(ctx, "tcp://127.0.0.1:*")
    with router, trio.fail_after(WAIT):
        with pytest.raises(PeerUnreachable) as info:
            await router_send(router, b"nobody", Drain())
    assert info.value.identity == b"nobody"


@pytest.mark.trio
async def test_cancelled_recv_leaves_socket_usable(ctx: zmq.Context[Any]) -> None:
    router, bound = gateway_router(ctx, "inproc://gw-cancel")
    with router:
        with trio.move_on_after(0.05) as scope:
            await router.recv_multipart()  # nothing arrives: must be cancellable
        assert scope.cancelled_caught
        dealer = worker_dealer(ctx, bound, WORKER)
        try:
            send(dealer, hello())
            with trio.fail_after(WAIT):
                assert await router_recv(router) == (dealer.getsockopt(zmq.ROUTING_ID), hello())
        finally:
            dealer.close()


@pytest.mark.trio
async def test_one_receiver_at_a_time_and_close_wakes_it(ctx: zmq.Context[Any]) -> None:
    router, _ = gateway_router(ctx, "inproc://gw-busy")
    errors: list[BaseException] = []

    async def receiver() -> None:
        try:
            await router.recv_multipart()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await router.recv_multipart()
            router.close()
    assert len(errors) == 1 and router.closed
    with pytest.raises(trio.ClosedResourceError):
        await router.send_multipart([b"x", b"y"])


def test_worker_send_times_out_when_hwm_is_full(ctx: zmq.Context[Any]) -> None:
    # Nobody reads from this router: the dealer's queue fills and send must not block past its timeout.
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = worker_dealer(ctx, f"tcp://127.0.0.1:{port}", WORKER, sndhwm=1)
    big = Generate("r", list(range(100_000)), SamplingParams(), None, 1.0, None, None)  # fills the TCP buffers quickly
    try:
        with pytest.raises(TimeoutError):
            for _ in range(1000):
                send(dealer, big, timeout_ms=50)
    finally:
        dealer.close()
        router.close()


def test_drain_incoming_returns_empty_after_timeout(ctx: zmq.Context[Any]) -> None:
    dealer = worker_dealer(ctx, "tcp://127.0.0.1:1", WORKER)  # nothing listens there
    try:
        started = time.monotonic()
        assert drain_incoming(dealer, timeout_ms=20) == []
        assert time.monotonic() - started < WAIT
    finally:
        dealer.close()


@pytest.mark.parametrize("bad_id", ["", "\x00reserved", "x" * 256])
def test_worker_identity_is_validated(ctx: zmq.Context[Any], bad_id: str) -> None:
    with pytest.raises(ValueError):
        worker_dealer(ctx, "tcp://127.0.0.1:1", bad_id)


def test_router_options_are_set_on_purpose(ctx: zmq.Context[Any]) -> None:
    router, _ = gateway_router(ctx, "tcp://127.0.0.1:*", sndhwm=123, rcvhwm=456)
    with router:
        sock = router.socket
        assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM)) == (123, 456)
        assert sock.getsockopt(zmq.LINGER) == 0
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) > 0 and sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0
    dealer = worker_dealer(ctx, "tcp://127.0.0.1:1", WORKER)
    try:
        # A fresh secret routing id per socket, never the nameable worker id (issue 24 item 1).
        routing_id = dealer.getsockopt(zmq.ROUTING_ID)
        assert isinstance(routing_id, bytes) and len(routing_id) == 33 and WORKER.encode() not in routing_id
        other = worker_dealer(ctx, "tcp://127.0.0.1:1", WORKER)
        assert other.getsockopt(zmq.ROUTING_ID) != routing_id
        other.close()
        assert dealer.getsockopt(zmq.LINGER) == 0 and dealer.getsockopt(zmq.HEARTBEAT_IVL) > 0
    finally:
        dealer.close()
