"""Which connection speaks for which worker: routing ids, the CURVE keys behind them, and refused Hellos.

A worker's ZeroMQ routing id is a secret of its socket (``ipc.sync_transport.connection_routing_id``), not its
worker id: the ROUTER hands a routing id to whichever connection last presented it, so a nameable one would let
a peer holding any listed key take a worker's place and receive its prompts (issue 24 item 1). The worker id
travels in Hello; the pool binds it here to the routing id that carried it and to the connection's key (the
ZAP User-Id), after ``authorize`` agreed that this key may serve that id (``gateway.fleet.worker_auth``). Every
later frame is accepted only from that routing id with that key. One owner: the pool's receive task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger("kvgate.gateway.pool")

# (the connection's Z85 key or None on a plain socket, the worker id its Hello claims) -> why not, or None
Authorize = Callable[[str | None, str], str | None]
_LOGGED_MAX: Final = 1024  # refusals remembered for log de-duplication: bounded whatever peers send


def allow_all(key: str | None, worker_id: str) -> str | None:
    """Without CURVE there are no keys to bind (the socket is loopback-only or explicitly --insecure-workers)."""
    return None


class WorkerIdentities:
    def __init__(self, authorize: Authorize = allow_all) -> None:
        self.authorize = authorize
        # routing id -> (the worker id of the admitted Hello it carried, the key its connection holds)
        self._bound: dict[bytes, tuple[str, str | None]] = {}
        self._routing_of: dict[str, bytes] = {}  # worker id -> its one current routing id
        self._logged: set[tuple[str, str | None]] = set()

    def refusal(self, key: str | None, worker_id: str) -> str | None:
        """Why this connection may not serve as ``worker_id`` (logged once per key and id), or None."""
        try:
            reason = self.authorize(key, worker_id)
        except Exception:  # a bug in the check refuses, never admits
            log.exception("worker id check failed")
            reason = "the gateway could not check this worker's key"
        if reason is not None and (worker_id, key) not in self._logged:
            if len(self._logged) < _LOGGED_MAX:
                self._logged.add((worker_id, key))
            log.warning("refused a Hello: the connection's key %s may not serve as worker %s (%s)", key or "(none)",
                        worker_id, reason, extra={"fields": {"event": "worker_id_refused", "worker_id": worker_id}})
        return reason

    def bind(self, identity: bytes, worker_id: str, key: str | None) -> None:
        """After an admitted Hello: ``identity`` speaks for ``worker_id`` (a previous connection no longer does)."""
        old = self._routing_of.get(worker_id)
        if old is not None and old != identity:
            self._bound.pop(old, None)
        previous = self._bound.get(identity)
        if previous is not None and previous[0] != worker_id:  # one socket renamed itself: its old id loses it
            self._routing_of.pop(previous[0], None)
        self._bound[identity] = (worker_id, key)
        self._routing_of[worker_id] = identity

    def worker_for(self, identity: bytes, key: str | None) -> str | None:
        """The worker id a non-Hello frame speaks for: None for a connection that never said an admitted Hello
        (or whose key is not the one bound: impossible unless a routing id leaked; then refused, loudly)."""
        bound = self._bound.get(identity)
        if bound is None:
            return None
        wid, bound_key = bound
        if bound_key != key:
            log.error("dropping a frame for worker %s: its connection's key is not the one bound to it", wid)
            return None
        return wid
