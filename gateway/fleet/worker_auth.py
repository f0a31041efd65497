"""Who may join as a worker: the gateway's CURVE keys, the allowed worker keys, and the ZAP handler.

With ``--worker-keys DIR`` the ROUTER is a CURVE server (``ipc.curve``): a peer must hold the secret half of a
public key listed in DIR (``*.key`` files) or of the key the gateway made for its own local workers. The
check runs in pyzmq's ``ThreadAuthenticator``: a ZAP handler in a thread of its own on the gateway's ZeroMQ
context, so handshakes never wait on the Trio loop and the Trio side never sees a peer that failed. A refused
peer is never connected to the ROUTER: it cannot send the gateway a frame, and nothing (a prompt least of all)
can be routed to it (a send to its identity is EHOSTUNREACH, as for a worker that never existed).

A listed key is bound to worker ids by its file name: ``NAME.key`` may serve as worker ``NAME`` or
``NAME/anything`` (several workers on one host share its key), and the gateway's own key serves only the workers
it starts; a Hello claiming another id is refused (``gateway.fleet.identities``), so no key can take over a
worker that another key serves.

DIR is read again at each handshake of a key it does not list, so a key file added while the gateway runs
lets that worker in at its next reconnect without a restart; a removed file keeps out new connections (an
established one stays until it drops; restart the gateway to cut it at once).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
from zmq.auth.thread import ThreadAuthenticator

from gateway.base.worker_security import WorkerSecurity
from ipc.curve import ENV_SECRET_KEY, ENV_SERVER_KEY, ZAP_DOMAIN, KeyPair, ServerCurve, load_key_pair, load_public_keys

log = logging.getLogger("kvgate.gateway.worker_auth")

REFUSAL_LOG_INTERVAL_S: Final = 60.0  # a refused worker retries every few seconds: one line per key per minute


class WorkerKeyring:
    """ZAP credentials provider: says whether a worker's public key is allowed, and logs refusals by key."""

    def __init__(self, directory: Path, local_keys: frozenset[bytes] = frozenset()) -> None:
        self._dir = directory
        self._local = local_keys
        self._lock = threading.Lock()  # the ZAP thread calls back; tests and reloads may read beside it
        self._listed = load_public_keys(directory)  # a missing or unreadable directory fails the start-up
        self._refused_logged: dict[bytes, float] = {}
        self.local_ids: frozenset[str] = frozenset()  # the ids of the workers the gateway starts (its own key's)
        log.info("worker keys: %d listed in %s", len(self._listed), directory,
                 extra={"fields": {"event": "worker_keys_loaded", "count": len(self._listed)}})

    def allowed(self, key: bytes) -> bool:
        with self._lock:
            if key in self._local or key in self._listed:
                return True
            try:  # maybe added since: a new worker joins without a gateway restart
                self._listed = load_public_keys(self._dir)
            except ValueError as e:
                log.error("cannot re-read worker keys: %s", e)
            return key in self._listed

    def refusal(self, key: str | None, worker_id: str) -> str | None:
        """Whether the connection with this key (its ZAP User-Id, Z85) may serve as ``worker_id``: None, or why
        not. A listed key ``NAME.key`` serves worker ids ``NAME`` and ``NAME/anything`` (a key file's name has
        no "/", so no key's ids overlap another's); the gateway's own key serves the workers it starts."""
        if key is None:
            return "the connection has no CURVE key"
        with self._lock:
            local = key.encode() in self._local
            name = self._listed.get(key.encode())
        if local:
            return None if worker_id in self.local_ids else "the gateway's own key serves only the workers it starts"
        if name is None:
            return f"key {key} is no longer listed in {self._dir}"
        if worker_id == name or worker_id.startswith(f"{name}/"):
            return None
        return f"key {name} may serve worker ids {name} and {name}/*"

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by pyzmq's authenticator (in its thread) with the client's Z85 public key."""
        try:
            ok = domain == ZAP_DOMAIN and self.allowed(key)
        except Exception:  # a bug here must refuse the peer, never kill the ZAP thread (that refuses everyone)
            log.exception("worker key check failed")
            ok = False
        name = key.decode(errors="replace")
        if ok:
            who = "local worker" if key in self._local else f"worker key {self._listed.get(key, '?')!r}"
            log.info("worker key %s accepted (%s)", name, who,
                     extra={"fields": {"event": "worker_key_accepted", "public_key": name}})
        else:
            self._log_refusal(name, key)
        return ok

    def _log_refusal(self, name: str, key: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._refused_logged.get(key)
            if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
                return
            self._refused_logged[key] = now
        log.warning("refused a worker: public key %s is not in %s (it gets no connection and no message)", name,
                    self._dir, extra={"fields": {"event": "worker_key_refused", "public_key": name}})


@dataclass
class WorkerAuth:
    """The running pieces of CURVE on the gateway's side."""

    server: ServerCurve
    local: KeyPair  # for the workers the supervisor starts (a fresh pair per gateway run)
    authenticator: ThreadAuthenticator
    keyring: WorkerKeyring

    def local_worker_env(self) -> dict[str, str]:
        return {ENV_SECRET_KEY: self.local.secret.decode(), ENV_SERVER_KEY: self.server.keys.public.decode()}

    def stop(self) -> None:
        self.authenticator.stop()


def start_worker_auth(ctx: zmq.Context[Any], security: WorkerSecurity) -> WorkerAuth | None:
    """Start the ZAP handler on ``ctx`` (before the ROUTER binds); None when CURVE is off. Call ``stop``
    before the context is terminated."""
    if security.worker_keys is None or security.server_secret_key is None:
        return None
    server = ServerCurve(load_key_pair(Path(security.server_secret_key)))
    local = KeyPair.generate()
    keyring = WorkerKeyring(Path(security.worker_keys), frozenset({local.public}))
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvgate.gateway.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=keyring)
    log.info("worker socket: CURVE, gateway public key %s", server.keys.public.decode(),
             extra={"fields": {"event": "worker_curve", "server_public_key": server.keys.public.decode()}})
    return WorkerAuth(server, local, auth, keyring)
