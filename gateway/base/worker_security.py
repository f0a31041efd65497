"""Who may join as a worker, as configured: ``WorkerSecurity`` is part of ``GatewayConfig`` (``gateway.config``) and
refuses, at start-up, a worker socket anyone on the network could join. What enforces it (the CURVE keys, the ZAP
handler, the key-to-id binding) is ``gateway.fleet.worker_auth``."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.curve import is_local_endpoint


@dataclass(frozen=True)
class WorkerSecurity:
    """How the worker socket is protected (``--worker-keys``, ``--server-secret-key``, ``--insecure-workers``)."""

    worker_keys: str | None = None  # directory of allowed worker public keys; set: CURVE on
    server_secret_key: str | None = None  # the gateway's own secret key file
    insecure_workers: bool = False  # allow a plain (no CURVE) ROUTER bound where other hosts can reach it

    @property
    def curve(self) -> bool:
        return self.worker_keys is not None

    def check(self, zmq_bind: str) -> None:
        """Refuse a configuration that would let anyone on the network drive the workers (or be one)."""
        if (self.worker_keys is None) != (self.server_secret_key is None):
            raise ValueError("--worker-keys and --server-secret-key go together: CURVE needs the allowed worker "
                             "keys and the gateway's own secret key (make one with: kvgate keys create gateway)")
        if self.curve and self.insecure_workers:
            raise ValueError("--insecure-workers contradicts --worker-keys (CURVE): give one or the other")
        if not self.curve and not self.insecure_workers and not is_local_endpoint(zmq_bind):
            raise ValueError(
                f"--zmq-bind {zmq_bind} is reachable from other hosts and the worker socket is not authenticated: "
                "anyone who can connect could pose as a worker and receive prompts. Use --worker-keys DIR with "
                "--server-secret-key FILE (ZeroMQ CURVE; keys from `kvgate keys create`), bind a loopback address, "
                "or pass --insecure-workers on a network you trust")
