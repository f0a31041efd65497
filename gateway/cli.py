"""The gateway's own command line, ``kvgate serve``: its flags (the gateway's and, in the "engine" group, the engine
flag table of ``common/engine_flags.py``, passed to the local workers), the ``GatewayConfig`` they make, and the run.
The operator console's ``kvgate`` dispatcher (console/kvgate.py) hands ``serve`` and its arguments here, as it hands
``worker`` to ``workers.process.cli``; ``python -m gateway serve ...`` runs it without the console."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

DEFAULT_PORT = 8000


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p: argparse.ArgumentParser = sub.add_parser("serve", help="serve the OpenAI API (gateway + local workers)")
    _serving_args(p)
    _worker_key_args(p.add_argument_group("remote workers (ZeroMQ CURVE; keys from `kvgate keys create`)"))
    _limit_args(p)
    _tenancy_args(p.add_argument_group("tenancy"))
    _engine_args(p.add_argument_group("engine (passed to local workers)"))
    _observability_args(p.add_argument_group("observability"))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="JSON lines (default) or readable text; prompt and completion text only for tenants that "
                        "opted in (kvgatectl tenant set-log-text)")
    return p


def _serving_args(p: argparse._ActionsContainer) -> None:
    """Where the gateway listens, what it serves, its local workers and their socket."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or safetensors directory")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--workers", type=int, default=1, help="local worker processes (0: only external workers)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: stop admitting (503, /ready false) and give in-flight requests this "
                        "many seconds to finish before exiting (default 30)")
    p.add_argument("--zmq-bind", default="tcp://127.0.0.1:0",
                   help="ROUTER address workers connect to; a fixed port lets workers started by hand join")


def _worker_key_args(w: argparse._ActionsContainer) -> None:
    """CURVE for workers on other hosts (gateway/fleet/worker_auth.py)."""
    w.add_argument("--worker-keys", default=None, metavar="DIR",
                   help="accept only workers whose public key is in DIR (*.key files); turns CURVE on")
    w.add_argument("--server-secret-key", default=None, metavar="FILE",
                   help="the gateway's own secret key file (NAME.key_secret); workers get its NAME.key")
    w.add_argument("--insecure-workers", action="store_true",
                   help="allow a --zmq-bind other hosts can reach without CURVE (anyone who connects can be a worker)")


def _limit_args(p: argparse._ActionsContainer) -> None:
    """Per-request and per-worker bounds, liveness timeouts, SSE and CORS."""
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is aborted")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="per worker, before answering 503 (the standard tier's; each tier scales it: kvgatectl tiers)")
    p.add_argument("--max-queued-prompt-tokens", type=int, default=262_144, help="per worker, before 503 (as above)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="seconds without any frame from a worker: frozen (its requests fail; a local one restarts)")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds one engine step may run before the worker counts as hung (as frozen)")
    p.add_argument("--sse-ping-interval", type=float, default=10.0)
    p.add_argument("--stream-stall-timeout", type=float, default=60.0,
                   help="seconds a stream's client may take no event (its socket full) before the gateway drops the "
                        "stream and aborts it on its worker, freeing its KV and pending outputs")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from this origin (scheme://host[:port], or '*') call the API from a "
                        "browser; repeatable; default: none (CORS off)")


def _tenancy_args(t: argparse._ActionsContainer) -> None:
    """The store, the admin API, shared rate-limit counters and the auth failure limit."""
    t.add_argument("--db", default=os.environ.get("KVGATE_DB", "kvgate.db"),
                   help="store of tenants, keys, quotas and usage: an SQLite file, or postgresql://... shared by "
                        "several gateways (needs KVGATE_SECRET) (env KVGATE_DB)")
    t.add_argument("--admin-token", default=os.environ.get("KVGATE_ADMIN_TOKEN"),
                   help="bearer token for /admin/* (env KVGATE_ADMIN_TOKEN; unset: admin API off)")
    t.add_argument("--redis-url", default=os.environ.get("KVGATE_REDIS_URL"),
                   help="share rate-limit and concurrency counters with other gateways (env KVGATE_REDIS_URL)")
    t.add_argument("--redis-fail-open", action="store_true",
                   help="admit without limits while Redis is unreachable (default: refuse with 503)")
    t.add_argument("--auth-failures-per-minute", type=int, default=20, help="per client address, then 429")
    t.add_argument("--no-demo-tenant", action="store_true", help="do not create tenant 'demo' on an empty store")
    t.add_argument("--responses-retention-days", type=float,
                   default=os.environ.get("KVGATE_RESPONSES_RETENTION_DAYS", "30"),  # argparse applies type
                   help="keep stored /v1/responses objects this long, then delete them (default 30; env "
                        "KVGATE_RESPONSES_RETENTION_DAYS)")
    t.add_argument("--max-file-bytes", type=int, default=100 * 1024 * 1024,
                   help="largest batch input file /v1/files accepts (default 100 MiB; held in memory and stored in "
                        "the database)")
    t.add_argument("--batch-lines-in-flight", type=int, default=8,
                   help="batch lines the leading gateway runs at once (default 8): the rest of the capacity stays "
                        "with interactive requests")


def _engine_args(g: argparse._ActionsContainer) -> None:
    """Engine flags the gateway passes to the workers it starts (the worker's own table: only those given)."""
    from common.engine_flags import add_engine_flags

    add_engine_flags(g, forwarded=True)


def _observability_args(o: argparse._ActionsContainer) -> None:
    """Cost series and trace export."""
    o.add_argument("--gpu-hour-cost", type=float, default=None,
                   help="price of one worker (GPU) per hour; /metrics then shows kvgate:cost_per_1k_tokens")
    o.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
                   help="send OpenTelemetry traces over OTLP/HTTP to this URL (default: "
                        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no traces leave the process)")


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    from common.engine_flags import given
    from gateway.config import (AdmissionConfig, BatchConfig, EngineArgs, GatewayConfig, ObservabilityConfig,
                                TenancyConfig, TimingConfig)
    from gateway.base.worker_security import WorkerSecurity

    return GatewayConfig(
        model=a.model, served_model_name=a.served_model_name, host=a.host, port=a.port, workers=a.workers,
        zmq_bind=a.zmq_bind, max_body_bytes=a.max_body_bytes, cors_origins=tuple(a.cors_origin),
        drain_timeout=a.drain_timeout,
        tenancy=TenancyConfig(db_path=a.db, admin_token=a.admin_token, redis_url=a.redis_url,
                              redis_fail_open=a.redis_fail_open,
                              auth_failures_per_minute=a.auth_failures_per_minute,
                              demo_tenant=not a.no_demo_tenant,
                              responses_retention_days=a.responses_retention_days),
        batch=BatchConfig(max_file_bytes=a.max_file_bytes, lines_in_flight=a.batch_lines_in_flight),
        engine=EngineArgs(**given(a)),
        admission=AdmissionConfig(max_requests=a.max_queued_requests, max_prompt_tokens=a.max_queued_prompt_tokens),
        timing=TimingConfig(request_timeout=a.request_timeout, heartbeat_timeout=a.heartbeat_timeout,
                            step_timeout=a.step_timeout,
                            sse_ping_interval=a.sse_ping_interval, stream_stall_timeout=a.stream_stall_timeout),
        observability=ObservabilityConfig(gpu_hour_cost=a.gpu_hour_cost, otlp_endpoint=a.otlp_endpoint or None,
                                          log_format=a.log_format),
        worker_security=WorkerSecurity(a.worker_keys, a.server_secret_key, a.insecure_workers))


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from common.logs import setup_logging
    from gateway.server import serve

    setup_logging(args.log_level, args.log_format)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"kvgate serve: error: {e}", file=sys.stderr)
        return 2
    try:
        trio.run(serve, cfg)
    except ValueError as e:  # an unknown model, a bad directory: a message, not a traceback
        print(f"kvgate serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """``kvgate serve ...`` (the dispatcher's ``serve``, or ``python -m gateway serve ...``): parse, then serve. No
    torch in this process."""
    parser = argparse.ArgumentParser(prog="kvgate", description="multi-tenant LLM serving")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return cmd_serve(parser.parse_args(sys.argv[1:] if argv is None else argv))
