"""A peer on a gateway's worker socket that is not the worker it claims to be (the worker-hijack drill).

It holds a real CURVE key pair (a listed one, or one the gateway does not know), presents the victim's worker id
as its ZeroMQ routing id (the name a ROUTER would once have routed that worker's prompts by), says a valid Hello
as the victim, then sends a Goodbye in the victim's name (which, if believed, would make the gateway drop the
real worker), and records every frame the gateway sends back. Blocking pyzmq, bounded by poll timeouts: the drill
runs each attempt in a thread of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from ipc.codec import decode, encode
from ipc.curve import ClientCurve, apply_client, load_key_pair, load_public_key
from ipc.messages import PROTOCOL_VERSION, Goodbye, Hello, Refused

ANSWER_WITHIN_S = 10.0  # the gateway answers a refused Hello at once; a loaded 2-core box may take seconds
AFTER_S = 0.5  # how long the peer keeps listening after its Goodbye (for anything else sent to it)


@dataclass
class Attempt:
    victim: str  # the worker id it claims (and presents as its routing id)
    key_name: str
    refusals: list[str] = field(default_factory=list)  # Refused reasons it was sent
    other_frames: list[str] = field(default_factory=list)  # anything else it was sent (a prompt, a ping...)
    error: str | None = None  # the attempt itself broke (not the gateway's answer)

    @property
    def refused_only(self) -> bool:
        """Told why it was refused, once, and sent nothing else."""
        return self.error is None and len(self.refusals) == 1 and not self.other_frames

    @property
    def silent(self) -> bool:
        """Sent nothing at all (what a key the gateway does not list must get: no connection, so no frame)."""
        return self.error is None and not self.refusals and not self.other_frames


def hello_as(victim: str, model: str) -> Hello:
    return Hello(PROTOCOL_VERSION, victim, os.getpid(), model, 4096, 16, 1024, 49152, [2], 8, 512)


def attempt(ctx: zmq.Context[Any], connect: str, keys: Path, key_name: str, victim: str, model: str,
            listed: bool) -> Attempt:
    """One hijack attempt with key ``key_name`` (``keys/NAME.key_secret``) against worker id ``victim``. A listed
    key waits for its Refused (up to ANSWER_WITHIN_S); an unlisted one listens ANSWER_WITHIN_S / 3 for anything."""
    out = Attempt(victim, key_name)
    curve = ClientCurve(load_key_pair(keys / f"{key_name}.key_secret"), load_public_key(keys / "gateway.key"))
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, victim.encode())  # the victim's name as routing id: the takeover try
        sock.setsockopt(zmq.LINGER, 0)
        apply_client(sock, curve)
        sock.connect(connect)
        sock.send(encode(hello_as(victim, model)), flags=zmq.NOBLOCK)
        sock.send(encode(Goodbye(victim, "hijack drill: a Goodbye in another worker's name")), flags=zmq.NOBLOCK)
        _collect(sock, out, ANSWER_WITHIN_S if listed else ANSWER_WITHIN_S / 3, stop_on_refusal=listed)
        if out.refusals:
            _collect(sock, out, AFTER_S, stop_on_refusal=False)
    except zmq.Again:
        pass  # nothing connected to take the frames: an unlisted key never gets a connection
    except zmq.ZMQError as e:
        out.error = f"ZMQError: {e}"
    finally:
        sock.close(linger=0)
    return out


def _collect(sock: zmq.Socket[bytes], out: Attempt, within_s: float, stop_on_refusal: bool) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    remaining_ms = int(within_s * 1000)
    while remaining_ms > 0:
        ready = dict(poller.poll(min(remaining_ms, 100)))
        remaining_ms -= 100
        if sock not in ready:
            continue
        frames = sock.recv_multipart()
        try:
            msg = decode(frames[-1])
        except Exception as e:  # noqa: BLE001 - anything it cannot read still counts as a frame it was sent
            out.other_frames.append(f"undecodable ({type(e).__name__})")
            continue
        if isinstance(msg, Refused):
            out.refusals.append(msg.reason)
            if stop_on_refusal:
                return
        else:
            out.other_frames.append(type(msg).__name__)
