"""Draining one worker (``kvgatectl worker drain``, ``POST /admin/workers/<id>/drain``): it finishes what it holds
and exits, and its supervisor starts a fresh one in the same slot.

The pool stops routing to the worker first (``WorkerPool.drain``); then this task queues ``Drain`` behind every
Generate already in the worker's outbox, so the worker never refuses a request the gateway sent it. The worker
runs its requests to their end, says Goodbye ("drained") and exits. Past the operator's timeout the requests it
still holds fail with ``drain_timeout`` (their clients get an OpenAI-shaped error event, their KV is freed) and the
worker is told to shut down, or killed if it does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import trio

from gateway.fleet.worker_state import WorkerState
from ipc.messages import Drain, Shutdown

log = logging.getLogger("kvgate.gateway.pool")

SHUTDOWN_GRACE_S: Final = 10.0  # after a drain timed out: how long a told worker may take to exit before a kill
DRAIN_TIMEOUT_CODE: Final = "drain_timeout"


async def drain_worker(w: WorkerState, timeout: float, kill_local: Callable[[str, int], bool]) -> None:
    """Tell ``w`` to drain and see it gone within ``timeout`` seconds, or cut what it still holds."""
    try:
        with trio.move_on_after(timeout):
            await w.outbox.send(Drain())  # waits only while the outbox is full (a worker behind on reading)
            await w.gone.wait()
            log.info("worker %s drained", w.worker_id)
            return
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        return  # the worker died meanwhile: the pool already failed its requests
    if w.gone.is_set():
        return
    log.warning("worker %s: drain timeout (%gs) passed with %d requests left; cutting them", w.worker_id, timeout,
                len(w.requests), extra={"fields": {"event": "worker_drain_timeout", "worker": w.worker_id,
                                                   "requests_cut": len(w.requests)}})
    for h in list(w.requests.values()):
        h.fail(DRAIN_TIMEOUT_CODE, f"the worker serving this request was restarted by the operator; the request "
                                   f"ran past the {timeout:g}s drain timeout")
    try:
        w.outbox.send_nowait(Shutdown())
    except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
        pass  # a worker that does not read its pipe is killed below
    with trio.move_on_after(SHUTDOWN_GRACE_S):
        await w.gone.wait()
        return
    if kill_local(w.worker_id, w.hello.pid):
        log.warning("killed worker %s (pid %d): it did not exit after its drain timeout", w.worker_id, w.hello.pid)
