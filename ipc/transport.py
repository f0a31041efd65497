"""ZeroMQ transport, Trio side: the adapter for the gateway's ROUTER, and typed send/recv over it.

Topology (DESIGN.md, "Wire protocol"): the gateway binds one ROUTER; every worker connects one DEALER whose
ZeroMQ identity is its worker id, so the gateway addresses a worker as ``[worker_id_bytes, payload]``.
Each ZeroMQ message carries exactly one msgpack frame from ``ipc.codec``. The worker's blocking half
(``worker_dealer``, ``send``, ``drain_incoming``) lives in ``ipc.sync_transport`` so the worker never imports
Trio; it is re-exported here so the gateway and tests find the whole transport in one place.

Why the Trio adapter is subtle: ``zmq.FD`` is not a readiness fd for the socket. It is the fd of libzmq's
internal command mailbox, it only signals *edges*, and any call that processes commands (send, recv, even
reading ``zmq.EVENTS``) may consume the edge. The rules followed here:

* always try the operation with ``zmq.NOBLOCK`` first; only on ``zmq.Again`` wait;
* before every wait re-read ``zmq.EVENTS`` (the state may already be ready, and the fd would never fire);
* after every send/recv re-read ``zmq.EVENTS`` and wake the other direction if it became ready, because our
  operation may have eaten the edge the other direction's waiter was sleeping on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import trio
import zmq

from ipc.codec import decode_or_none, encode
from ipc.curve import ServerCurve, apply_server
from ipc.messages import GatewayToWorker, WorkerToGateway
from ipc.sync_transport import (
    DEFAULT_HEARTBEAT_IVL_MS,
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    DEFAULT_RCVHWM,
    DEFAULT_SNDHWM,
    configure_socket,
    drain_incoming,
    send,
    worker_dealer,
)

__all__ = [
    "PeerUnreachable",
    "TrioZmqSocket",
    "drain_incoming",
    "gateway_router",
    "router_recv",
    "router_send",
    "router_try_send",
    "send",
    "worker_dealer",
]

_log = logging.getLogger(__name__)


class PeerUnreachable(Exception):
    """The ROUTER has no connection for this identity (worker gone or never connected)."""

    def __init__(self, identity: bytes) -> None:
        super().__init__(f"no connected peer with identity {identity!r}")
        self.identity = identity


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    value = sock.getsockopt(option)
    if not isinstance(value, int):  # pyzmq types getsockopt as int | bytes; FD and EVENTS are ints
        raise TypeError(f"socket option {option} is not an int: {type(value).__name__}")
    return value


# --------------------------------------------------------------------------------------------------
# Trio adapter
# --------------------------------------------------------------------------------------------------


class TrioZmqSocket:
    """A non-blocking ``zmq.Socket`` driven by Trio.

    Concurrency contract: at most one task may be inside ``recv_multipart`` and at most one inside
    ``send_multipart`` at any time (a second one raises ``trio.BusyResourceError``, as Trio's own streams
    do). A receiving task and a sending task may run concurrently. Several producers send through one
    memory channel drained by ``send_all_from`` (or serialize themselves with a ``trio.Lock``).

    Trio allows only one task to ``wait_readable`` on an fd, so whichever direction has to wait first parks
    on the fd and the other parks on an Event; whoever wakes, or changes the socket's state by a send/recv,
    re-reads EVENTS and wakes the others when a flag they wait for is set.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = _int_option(sock, zmq.FD)
        self._fd_scope: trio.CancelScope | None = None  # set while some task sleeps in wait_readable(fd)
        self._changed = trio.Event()  # set (and replaced) to wake tasks not sleeping on the fd
        self._wanted = 0  # POLLIN/POLLOUT bits some task is currently waiting for
        self._busy: set[str] = set()  # "send"/"recv" while a task is inside that operation
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The wrapped socket, for options and introspection; never send/recv on it directly."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message, waiting (cancellably) while the peer's pipe is at its HWM."""
        with self._exclusive("send"):
            await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                self._check_open()
                try:
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await self._wait_for(zmq.POLLOUT)
            self._refresh_events()
            # Sent: a cancellation arriving now must not pretend the message was not sent.
            await trio.lowlevel.cancel_shielded_checkpoint()

    def try_send_multipart(self, frames: Sequence[bytes]) -> bool:
        """Send now or not at all: False when the peer's pipe is at its high-water mark.

        Synchronous, so any number of tasks may use it side by side: on a ROUTER with ROUTER_MANDATORY a full
        pipe is reported per peer (EAGAIN), and each caller retries on its own schedule, so one peer that
        stopped reading never holds up sends to the others (a waiting ``send_multipart`` would, and POLLOUT on
        a ROUTER is set while *any* peer's pipe has room, so waiting for it cannot target one peer)."""
        if "send" in self._busy:
            raise trio.BusyResourceError("another task is in send_multipart on this socket")
        self._check_open()
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._refresh_events()  # the send may have eaten the edge a receiving task sleeps on
        return True

    async def recv_multipart(self) -> list[bytes]:
        """Receive one multipart message (ZeroMQ delivers all parts or none)."""
        return [f.bytes for f in await self.recv_frames()]

    async def recv_frames(self) -> list[zmq.Frame]:
        """``recv_multipart`` as ``zmq.Frame`` objects, which carry the connection's properties (the ZAP
        User-Id: ``frame.get("User-Id")``)."""
        with self._exclusive("recv"):
            await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                self._check_open()
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    await self._wait_for(zmq.POLLIN)
            self._refresh_events()
            # Received: raising Cancelled now would silently lose the message.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames

    async def send_all_from(self, channel: trio.MemoryReceiveChannel[list[bytes]]) -> None:
        """Be the one sender task: send everything producers put into ``channel`` until it closes."""
        async with channel:
            async for frames in channel:
                await self.send_multipart(frames)

    def close(self) -> None:
        """Close the socket; tasks blocked in send/recv get ``trio.ClosedResourceError``."""
        if self._closed:
            return
        self._closed = True
        if trio.lowlevel.in_trio_run():  # outside a Trio run nobody can be parked on the fd
            trio.lowlevel.notify_closing(self._fd)  # must precede the close: wakes the task parked on the fd
        self._wake_waiters()
        self._sock.close()  # honours the LINGER option set by the helpers below

    def __enter__(self) -> TrioZmqSocket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self, op: str) -> Iterator[None]:
        if op in self._busy:
            raise trio.BusyResourceError(f"another task is already in {op} on this socket")
        self._busy.add(op)
        try:
            yield
        finally:
            self._busy.discard(op)

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("socket was closed")

    def _refresh_events(self) -> int:
        """Read EVENTS; wake the other waiters if their flag is set (this read may have eaten their edge)."""
        events = _int_option(self._sock, zmq.EVENTS)
        if events & self._wanted:
            self._wake_waiters()
        return events

    async def _wait_for(self, flag: int) -> None:
        self._wanted |= flag
        try:
            while not self._refresh_events() & flag:
                await self._wait_for_change()
                self._check_open()
        finally:
            self._wanted &= ~flag

    async def _wait_for_change(self) -> None:
        if self._fd_scope is not None:
            # Another task owns the fd (Trio forbids two waiters); it wakes us when anything happens.
            await self._changed.wait()
            return
        with trio.CancelScope() as scope:  # cancelled by _wake_waiters when another task saw a change
            self._fd_scope = scope
            try:
                await trio.lowlevel.wait_readable(self._fd)
            finally:
                self._fd_scope = None
                # The fd fired or we are leaving: let the other direction re-check and take over the fd.
                self._wake_waiters()

    def _wake_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
        if self._fd_scope is not None:
            self._fd_scope.cancel()


# --------------------------------------------------------------------------------------------------
# the gateway's ROUTER
# --------------------------------------------------------------------------------------------------


def gateway_router(
    ctx: zmq.Context[Any],
    bind_addr: str,
    *,
    sndhwm: int = DEFAULT_SNDHWM,
    rcvhwm: int = DEFAULT_RCVHWM,
    heartbeat_ivl_ms: int = DEFAULT_HEARTBEAT_IVL_MS,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    curve: ServerCurve | None = None,
) -> tuple[TrioZmqSocket, str]:
    """Bind the gateway's ROUTER. Returns the Trio socket and the bound address (a ``*`` port resolved).
    With ``curve`` only peers that pass the CURVE handshake and the context's ZAP handler are connected: the
    ROUTER never sees a frame from, nor routes one to, anyone else."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    try:
        # MANDATORY: without it a ROUTER silently drops frames to an unknown peer or to a full pipe. We want
        # EHOSTUNREACH (-> PeerUnreachable) for the first, and EAGAIN, i.e. waiting = backpressure, for
        # the second: a silently lost Abort would leak a request's KV blocks on the worker.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # HANDOVER: a worker restarted under the same id takes over its identity at once, instead of being
        # refused until the router notices the old connection is dead.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        configure_socket(sock, sndhwm, rcvhwm, heartbeat_ivl_ms, heartbeat_timeout_ms)
        if curve is not None:
            apply_server(sock, curve)
        sock.bind(bind_addr)
        actual = sock.getsockopt(zmq.LAST_ENDPOINT)
    except BaseException:
        sock.close(linger=0)
        raise
    address = actual.decode() if isinstance(actual, bytes) else str(actual)
    return TrioZmqSocket(sock), address


# --------------------------------------------------------------------------------------------------
# gateway side (Trio): typed send/recv over the ROUTER
# --------------------------------------------------------------------------------------------------


@contextmanager
def _unreachable_as_peer_error(identity: bytes) -> Iterator[None]:
    """ROUTER_MANDATORY reports a peer it has no connection for as EHOSTUNREACH: PeerUnreachable."""
    try:
        yield
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            raise PeerUnreachable(identity) from exc
        raise


async def router_send(sock: TrioZmqSocket, identity: bytes, msg: GatewayToWorker) -> None:
    """Send a message to one worker; waits while its pipe is full. Raises PeerUnreachable if it is gone."""
    with _unreachable_as_peer_error(identity):
        await sock.send_multipart([identity, encode(msg)])


def router_try_send(sock: TrioZmqSocket, identity: bytes, msg: GatewayToWorker) -> bool:
    """Send a message to one worker if its pipe has room now (False if not). Raises PeerUnreachable."""
    with _unreachable_as_peer_error(identity):
        return sock.try_send_multipart([identity, encode(msg)])


def _peer_name(identity: bytes) -> str:
    return identity.decode(errors="replace")


def _as_worker_message(frames: list[bytes]) -> tuple[bytes, WorkerToGateway] | None:
    if len(frames) != 2:  # [identity, payload]; a DEALER that sent multipart is broken
        _log.warning("dropping %d-part message on the router (want identity + 1 frame)", len(frames))
        return None
    identity, payload = frames
    msg = decode_or_none(payload, peer=_peer_name(identity), logger=_log)
    if msg is None:
        return None
    if not isinstance(msg, WorkerToGateway):
        _log.warning("dropping %s from %s: not a worker->gateway message", type(msg).__name__,
                     _peer_name(identity))
        return None
    return identity, msg


async def router_recv(sock: TrioZmqSocket) -> tuple[bytes, WorkerToGateway]:
    """Next valid message and its sender's identity. Malformed frames are logged and skipped, never raised."""
    identity, msg, _ = await router_recv_from(sock)
    return identity, msg


async def router_recv_from(sock: TrioZmqSocket) -> tuple[bytes, WorkerToGateway, str | None]:
    """``router_recv`` plus the sender's User-Id: under CURVE the Z85 public key its connection authenticated
    with (set by the ZAP handler, so a peer cannot choose it); None on a plain socket."""
    while True:
        frames = await sock.recv_frames()
        received = _as_worker_message([f.bytes for f in frames])
        if received is not None:
            return (*received, _user_id(frames[-1]))


def _user_id(frame: zmq.Frame) -> str | None:
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: the connection has no such property (no ZAP handler: plain ZeroMQ)
        return None
    return value if isinstance(value, str) and value else None
