"""Gateway configuration: one frozen dataclass of sub-configs, validated on construction.

The engine knobs are not interpreted here: they are passed through to every local worker's command line
(the worker validates them for real); the gateway only checks what it needs to route and to refuse early.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from common import engine_flags
from gateway.base.worker_security import WorkerSecurity

_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class EngineArgs:
    """The engine flags ``kvgate serve`` was given (``common.engine_flags``), forwarded to the workers it starts as
    ``--flag value``; a flag not given is left to the worker's default."""

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(engine_flags.FLAGS_BY_DEST))
        if unknown:
            raise TypeError(f"not an engine flag: {unknown[0]}")
        self.values = {k: v for k, v in values.items() if v is not None and v is not False}  # 0 stays: refused
        engine_flags.check(self.values)  # a bad value fails here, before any worker starts

    @property
    def device(self) -> str:
        return str(self.values.get("device", "cpu"))

    @property
    def num_threads(self) -> int | None:
        v = self.values.get("num_threads")
        return None if v is None else int(v)

    def argv(self) -> list[str]:
        return engine_flags.argv(self.values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineArgs) and self.values == other.values

    def __repr__(self) -> str:
        return f"EngineArgs({self.values!r})"


@dataclass(frozen=True)
class AdmissionConfig:
    """Per-worker bounds on what the gateway hands a worker before answering 503 (never an unbounded queue)."""

    # In flight on one worker (running + waiting there), and their prompt tokens. A tenant holding less than its
    # weighted share of them there still gets in, up to twice them (gateway/fleet/routing.py).
    max_requests: int = 256
    max_prompt_tokens: int = 262_144
    affinity_entries: int = 10_000  # bounded LRU of prefix hash -> worker
    affinity_slack: int = 8  # follow a prefix to its worker unless it has this many more requests than the least loaded
    # ... and unless that worker holds this many more of the tenant's requests than the worker holding fewest:
    # a tenant pinned to one worker is absent from the others' fair queues (gateway/fleet/routing.py)
    tenant_slack: int = 2

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_prompt_tokens < 1 or self.affinity_entries < 1:
            raise ValueError("admission bounds must be >= 1")
        if self.affinity_slack < 0 or self.tenant_slack < 0:
            raise ValueError("affinity_slack and tenant_slack must be >= 0")


@dataclass(frozen=True)
class TimingConfig:
    request_timeout: float | None = None  # seconds per request, None: no deadline
    heartbeat_timeout: float = 3.0  # a worker with no frame at all this long is frozen (its I/O thread is)
    step_timeout: float = 300.0  # one engine step running longer than this: hung (treated as frozen)
    sse_ping_interval: float = 10.0  # ": ping" comment while a stream waits for its next token
    stream_stall_timeout: float = 60.0  # a stream whose client takes no event this long is dropped (and aborted)
    ipc_send_timeout: float = 5.0  # every send to a worker is bounded; past it the worker is declared dead
    restart_backoff_initial: float = 0.5
    restart_backoff_max: float = 30.0

    def __post_init__(self) -> None:
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")
        for name in ("heartbeat_timeout", "step_timeout", "sse_ping_interval", "stream_stall_timeout",
                     "ipc_send_timeout", "restart_backoff_initial", "restart_backoff_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class TenancyConfig:
    # Tenants, keys, quotas, usage ledger: an SQLite (WAL) file with the secret beside it, or a postgresql:// URL
    # (several gateways, one database; the secret then comes from KVGATE_SECRET).
    db_path: str = "kvgate.db"
    admin_token: str | None = None  # guards /admin/*; None: the admin API is off
    redis_url: str | None = None  # shared rate-limit/concurrency counters for several gateways
    redis_fail_open: bool = False  # Redis unreachable: refuse (503, default) or admit without limits
    auth_cache_ttl: float = 1.0  # seconds a key's tenant and quotas are cached (CLI changes apply within it)
    auth_failures_per_minute: int = 20  # failed authentications allowed per client address
    demo_tenant: bool = True  # on an empty store, create tenant "demo" and print its key once
    responses_retention_days: float = 30.0  # stored /v1/responses objects older than this are gone (and pruned)

    def __post_init__(self) -> None:
        if not self.db_path:
            raise ValueError("--db must not be empty")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("--admin-token must be at least 16 characters")
        if not 0 < self.auth_cache_ttl <= 2.0:
            raise ValueError("auth_cache_ttl must be in (0, 2] seconds: revocations must apply within 2 s")
        if self.auth_failures_per_minute < 1:
            raise ValueError("--auth-failures-per-minute must be >= 1")
        if not 0 < self.responses_retention_days < float("inf"):
            raise ValueError(f"--responses-retention-days must be > 0, got {self.responses_retention_days}")


@dataclass(frozen=True)
class BatchConfig:
    """The Batch API's bounds (``/v1/files``, ``/v1/batches``; gateway/batches/)."""

    max_file_bytes: int = 100 * 1024 * 1024  # an upload is held in memory whole (and stored in the database)
    max_file_lines: int = 50_000  # requests in one input file, OpenAI's limit
    lines_in_flight: int = 8  # batch lines the leading gateway runs at once: interactive traffic keeps the rest

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1:
            raise ValueError(f"--max-file-bytes must be >= 1, got {self.max_file_bytes}")
        if self.max_file_lines < 1:
            raise ValueError(f"max_file_lines must be >= 1, got {self.max_file_lines}")
        if self.lines_in_flight < 1:
            raise ValueError(f"--batch-lines-in-flight must be >= 1, got {self.lines_in_flight}")


@dataclass(frozen=True)
class ObservabilityConfig:
    gpu_hour_cost: float | None = None  # price of one worker (a GPU) for an hour; turned into cost per 1k tokens
    otlp_endpoint: str | None = None  # OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces); None: off
    log_format: str = "json"  # the gateway's, passed on to the workers it starts so one stream has one format

    def __post_init__(self) -> None:
        if self.gpu_hour_cost is not None and not 0 <= self.gpu_hour_cost < float("inf"):
            raise ValueError(f"--gpu-hour-cost must be a finite number >= 0, got {self.gpu_hour_cost}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"--log-format must be json or text, got {self.log_format!r}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--otlp-endpoint must be an http(s) URL, got {self.otlp_endpoint!r}")


@dataclass(frozen=True)
class GatewayConfig:
    model: str = "smollm2"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # local worker subprocesses to spawn and supervise (0: external workers only)
    zmq_bind: str = "tcp://127.0.0.1:0"
    max_body_bytes: int = 4 * 1024 * 1024
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); empty: CORS off
    drain_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may take to finish before the gateway ends
    engine: EngineArgs = field(default_factory=EngineArgs)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    worker_security: WorkerSecurity = field(default_factory=WorkerSecurity)  # CURVE on the worker socket

    def __post_init__(self) -> None:
        self.worker_security.check(self.zmq_bind)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"--drain-timeout must be in [0, 3600] seconds, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        for origin in self.cors_origins:
            # An origin is scheme://host[:port] exactly as browsers send it: a path or a trailing slash never matches.
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"--cors-origin must be '*' or scheme://host[:port] (no path), got {origin!r}")

    @property
    def model_name(self) -> str:
        """The name clients must send as ``model`` (and that /v1/models lists)."""
        return self.served_model_name or self.model
