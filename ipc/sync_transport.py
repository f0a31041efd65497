"""The synchronous half of the transport: socket options, the worker's DEALER and its blocking helpers.

Kept free of Trio (and of everything but zmq and the codec) because the worker process is synchronous and
``workers/`` must not import trio: the worker loop polls its DEALER between engine steps with a timeout.
The Trio side (the gateway's ROUTER) is ``ipc.transport``, which builds on the options defined here.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Final

import zmq

from ipc.codec import MAX_FRAME_BYTES, decode_or_none, encode
from ipc.curve import ClientCurve, apply_client
from ipc.messages import GatewayToWorker, Message

_log = logging.getLogger(__name__)

# High-water marks are our backpressure, so they are set on purpose rather than left at libzmq's default.
# Counted in messages per peer pipe. 1000 frames is seconds of StepOutputs (one per engine step) or a burst of
# Generates far beyond what a worker admits between two steps; past that the sender should *wait* (gateway:
# the route task blocks under its fail_after; worker: the engine loop stalls) instead of buffering without
# bound. A few MB of queued frames per worker at most, never an OOM when one side stops reading.
DEFAULT_SNDHWM: Final = 1000
DEFAULT_RCVHWM: Final = 1000
# ZMTP heartbeats detect a peer that vanished without closing TCP (host down, cable pulled, SIGSTOP):
# a PING every second, and a connection with no traffic for 5 s is dropped. The router then forgets the
# worker's identity (sends raise PeerUnreachable) and the dealer reconnects.
DEFAULT_HEARTBEAT_IVL_MS: Final = 1000
DEFAULT_HEARTBEAT_TIMEOUT_MS: Final = 5000
# Back off reconnects up to this, so a restarting gateway is not hammered by every worker at 10 Hz.
DEFAULT_RECONNECT_IVL_MAX_MS: Final = 5000
# A worker id travels in Hello and Stats: 1..255 UTF-8 bytes, not starting with NUL (libzmq's reserved ids:
# ids were routing ids before protocol 6, and an id that cannot be one would confuse anyone reading a capture).
_MAX_IDENTITY_BYTES: Final = 255


def configure_socket(sock: zmq.Socket[bytes], sndhwm: int, rcvhwm: int, heartbeat_ivl_ms: int,
                     heartbeat_timeout_ms: int) -> None:
    """Options every kvgate socket gets, whichever side and type."""
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    # LINGER 0: on close drop unsent frames instead of blocking process exit on a dead peer; everything we
    # send is either re-sent on reconnect (Hello, Stats) or failed by the gateway anyway.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_timeout_ms)  # the peer applies the same timeout to us
    # A peer announcing a larger frame is disconnected before it is buffered (codec refuses it anyway).
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)  # + room for the routing-id frame


def check_worker_id(worker_id: str) -> None:
    identity = worker_id.encode()
    if not 0 < len(identity) <= _MAX_IDENTITY_BYTES or identity.startswith(b"\x00"):
        raise ValueError(f"worker id must be 1..{_MAX_IDENTITY_BYTES} UTF-8 bytes, not starting with NUL")


def connection_routing_id() -> bytes:
    """A fresh routing id for one worker socket: 128 random bits as hex, never the worker id. The ROUTER
    delivers to whichever connection last presented a routing id (ROUTER_HANDOVER), so a routing id anyone
    could name (a worker id is in logs, metrics and admin pages) would let a peer holding another listed key
    connect under it and receive the prompts meant for that worker. Under CURVE the routing id travels
    encrypted, so only the socket that made it can present it; the gateway maps it to the worker id of the
    Hello it carried, and checks that worker id against the connection's key (gateway.fleet.worker_auth)."""
    return b"c" + secrets.token_hex(16).encode()  # never starts with NUL (reserved by libzmq)


def worker_dealer(
    ctx: zmq.Context[Any],
    connect_addr: str,
    worker_id: str,
    *,
    sndhwm: int = DEFAULT_SNDHWM,
    rcvhwm: int = DEFAULT_RCVHWM,
    heartbeat_ivl_ms: int = DEFAULT_HEARTBEAT_IVL_MS,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    curve: ClientCurve | None = None,
) -> zmq.Socket[bytes]:
    """Connect a worker's DEALER (a blocking socket for the synchronous worker loop) under a routing id of its
    own (``connection_routing_id``; ``worker_id`` is only checked here: it travels in Hello); with ``curve`` as
    a CURVE client of the gateway whose public key it names."""
    check_worker_id(worker_id)
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, connection_routing_id())  # must be set before connect
        configure_socket(sock, sndhwm, rcvhwm, heartbeat_ivl_ms, heartbeat_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, DEFAULT_RECONNECT_IVL_MAX_MS)
        if curve is not None:
            apply_client(sock, curve)
        sock.connect(connect_addr)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


# --------------------------------------------------------------------------------------------------
# blocking send/receive for the worker loop
# --------------------------------------------------------------------------------------------------


def send(sock: zmq.Socket[bytes], msg: Message, timeout_ms: int | None = None) -> None:
    """Send one message. Blocks while the HWM is reached (backpressure) or no gateway is connected;
    with ``timeout_ms`` raises TimeoutError instead of blocking longer than that."""
    data = encode(msg)
    if timeout_ms is None:
        sock.send(data)
        return
    if not sock.poll(timeout_ms, zmq.POLLOUT):
        raise TimeoutError(f"could not send {type(msg).__name__} within {timeout_ms} ms")
    try:
        sock.send(data, flags=zmq.NOBLOCK)
    except zmq.Again as exc:  # became full between poll and send
        raise TimeoutError(f"could not send {type(msg).__name__} within {timeout_ms} ms") from exc


def _as_gateway_message(frames: list[bytes]) -> GatewayToWorker | None:
    if len(frames) != 1:
        _log.warning("dropping %d-part message on the dealer (want 1 frame)", len(frames))
        return None
    msg = decode_or_none(frames[0], peer="gateway", logger=_log)
    if msg is None:
        return None
    if not isinstance(msg, GatewayToWorker):
        _log.warning("dropping %s from gateway: not a gateway->worker message", type(msg).__name__)
        return None
    return msg


def drain_incoming(
    sock: zmq.Socket[bytes], timeout_ms: int, max_messages: int = 1000
) -> list[GatewayToWorker]:
    """Wait up to ``timeout_ms`` (0: don't wait) for input, then take everything queued, up to
    ``max_messages`` frames so a flood cannot starve the engine step. Bad frames are logged and dropped."""
    poller = zmq.Poller()  # zmq_poll re-reads EVENTS itself, so the edge-triggered FD is no issue here
    poller.register(sock, zmq.POLLIN)
    if not poller.poll(timeout_ms):
        return []
    messages: list[GatewayToWorker] = []
    for _ in range(max_messages):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            break
        msg = _as_gateway_message(frames)
        if msg is not None:
            messages.append(msg)
    return messages
