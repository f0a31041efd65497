"""One sender per worker: its own bounded queue and task, so a worker that stops reading stalls only itself.

Route handlers and the pool's receive loop never wait on a socket: they put ``Generate`` and ``Abort`` into the
worker's outbox (``send_nowait``) and the worker's sender task moves them to the ROUTER. The ROUTER reports a
full pipe per peer (ROUTER_MANDATORY: EAGAIN), so the sender retries with a short backoff while other workers'
senders go on; a pipe that stays full past ``ipc_send_timeout`` means the worker is not reading, and the
sender reports it (the pool then declares the worker dead and fails its requests).

Aborts queued in one batch travel as one Abort frame after the batch's Generates, so an Abort never overtakes
the Generate of its own request. Control messages (Drain, Shutdown) go last: every Generate queued before a
Drain reaches the worker before it stops taking new requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import trio

from ipc.messages import Abort, Drain, Generate, Shutdown
from ipc.transport import PeerUnreachable, TrioZmqSocket, router_try_send

log = logging.getLogger("kvgate.gateway.pool")

# Bound of one worker's outbox, in messages. Generates in it are bounded by admission (a worker holds at most
# AdmissionConfig.max_requests requests), aborts by one per request plus reconciliation repeats; past this the
# worker has not read for a while: a Generate is refused with 503, an Abort is left to the next heartbeat's
# reconciliation (the worker lists what it holds; what the gateway no longer tracks is aborted again).
OUTBOX_BOUND: Final = 1024
_RETRY_INITIAL_S: Final = 0.001
_RETRY_MAX_S: Final = 0.05

Outgoing = Generate | Abort | Drain | Shutdown


def open_outbox() -> tuple[trio.MemorySendChannel[Outgoing], trio.MemoryReceiveChannel[Outgoing]]:
    return trio.open_memory_channel[Outgoing](OUTBOX_BOUND)


def coalesce(batch: list[Outgoing]) -> list[Outgoing]:
    """The batch's Generates in order, then all its aborted ids (deduplicated, in order) as one Abort, then its
    control messages (Drain, Shutdown) in order."""
    gens: list[Outgoing] = [m for m in batch if isinstance(m, Generate)]
    ids = list(dict.fromkeys(rid for m in batch if isinstance(m, Abort) for rid in m.request_ids))
    control = [m for m in batch if isinstance(m, (Drain, Shutdown))]
    return gens + ([Abort(ids)] if ids else []) + control


async def _send_one(sock: TrioZmqSocket, identity: bytes, msg: Outgoing) -> None:
    delay = _RETRY_INITIAL_S
    while not router_try_send(sock, identity, msg):
        await trio.sleep(delay)  # this worker's pipe is full: only this sender waits
        delay = min(delay * 2, _RETRY_MAX_S)


async def run_sender(sock: TrioZmqSocket, identity: bytes, outbox: trio.MemoryReceiveChannel[Outgoing],
                     send_timeout: float, on_failure: Callable[[str], None]) -> None:
    """Drain ``outbox`` to the worker until the channel closes. Never raises: a failure to send (peer gone,
    pipe full past ``send_timeout``, a bug) is handed to ``on_failure`` with a reason, and the task ends."""
    try:
        async with outbox:
            async for first in outbox:
                batch = [first]
                while True:
                    try:
                        batch.append(outbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                for msg in coalesce(batch):
                    with trio.fail_after(send_timeout):
                        await _send_one(sock, identity, msg)
    except PeerUnreachable:
        on_failure("send failed: peer unreachable")
    except trio.TooSlowError:
        on_failure(f"send failed: its pipe stayed full for {send_timeout:.0f}s")
    except trio.ClosedResourceError:
        pass  # the gateway is shutting down and closed the socket
    except Exception as e:  # a bug here must cost one worker, never the pool's nursery
        log.exception("sender for a worker failed")
        on_failure(f"sender failed: {type(e).__name__}")
