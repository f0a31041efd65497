"""Run a whole gateway: the worker pool on its ROUTER, the local worker supervisor, and Hypercorn (trio).

Lifecycle as nested nurseries: the outer one holds the pool, the supervisor and the background tasks (ledger
writer, quota settler, stored-responses pruner, batch runner), the inner one the HTTP server. SIGINT/SIGTERM first
drains (new API requests get 503 with retry-after, /ready turns false, the batch runner starts no new line, requests
and batch lines in flight get up to ``--drain-timeout`` to finish), then stops the HTTP server (Hypercorn gives the
last responses ``graceful_timeout`` to flush), then the workers are told to shut down and the outer nursery is
cancelled, which terminates (then kills) every local worker. Nothing outlives ``serve``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypercorn.trio
import trio
import zmq
from hypercorn.config import Config as HyperConfig

from gateway.pipeline.adapters import AdapterCatalog
from gateway.pipeline.admission import QuotaGate
from gateway.api.app import create_app
from gateway.api.auth import Authenticator
from gateway.config import GatewayConfig, TenancyConfig
from gateway.telemetry.gateway_metrics import GatewayMetrics
from gateway.pipeline.ledger import UsageLedger
from gateway.fleet.pool import WorkerPool
from gateway.api.state import GatewayState, Tenancy
from gateway.fleet.supervisor import Supervisor
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from gateway.telemetry.tracing import Tracing
from gateway.fleet.worker_auth import WorkerAuth, start_worker_auth
from ipc.transport import gateway_router
from tenancy.limiter import Limiter, RateLimiter
from tenancy.server_secret import ServerSecret
from gateway.batches.line import LineRunner, Pipeline, batch_priority
from gateway.batches.runner import LEASE_TTL_S, BatchRunner
from gateway.batches.stored import StoredBatches
from gateway.responses.stored import StoredResponses
from tenancy.adapter_ops import AdapterAdmin
from tenancy.adapters_store import AdapterStore
from tenancy.db_backend import redact
from tenancy.lora_check import LoraContext
from tenancy.responses_store import ResponseStore
from tenancy.store import TenancyStore, open_store

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("kvgate.gateway.server")

GRACEFUL_TIMEOUT_S = 5.0
CUT_GRACE_S = 0.2  # after a drain timed out: just long enough to send what is already written
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn (4096 on current Linux)


def _hypercorn_config(cfg: GatewayConfig) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S  # deliberate: the default 3 s would cut streams on SIGTERM
    # Hypercorn's default listen backlog (100) overflowed under a burst of 640 connections (the overload drill):
    # the kernel dropped handshakes and clients saw resets, not the 429/503 the gateway would have answered.
    hc.backlog = LISTEN_BACKLOG
    hc.accesslog = None  # request lines carry no prompt, but per-request logging is the tracing issue's job
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def _wait_for_signal(stop: trio.Event, state: GatewayState, hc: HyperConfig) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: draining", signal.Signals(signum).name)
            if not await _drain(state):
                # Past the drain timeout: Hypercorn reads its grace at shutdown, so the streams still running are
                # cut now instead of getting another GRACEFUL_TIMEOUT_S.
                hc.graceful_timeout = CUT_GRACE_S
            stop.set()
            return


async def _drain(state: GatewayState) -> bool:
    """Stop admitting (503 on /v1, /ready false) and wait, up to --drain-timeout, for the requests the workers
    hold to finish; Hypercorn's graceful timeout then flushes their last bytes. Streams still running at the
    deadline are cut when the server stops. True when nothing was left in flight."""
    state.draining = True
    timeout = state.config.drain_timeout
    with trio.move_on_after(timeout) as waited:
        while state.pool.num_inflight:
            await trio.sleep(0.05)
    left = state.pool.num_inflight
    log.info("drained" if not waited.cancelled_caught else "drain timeout: stopping with requests in flight",
             extra={"fields": {"event": "drain_done", "in_flight": left, "drain_timeout_s": timeout}})
    if waited.cancelled_caught:
        # End what is left as a worker drain does: an error its client can read (an SSE error event, or a 503
        # not yet answered) rather than a stream that stops without [DONE] when the server closes it.
        for handle in state.pool.inflight():
            handle.fail("gateway_shutdown", f"the gateway is shutting down and this request ran past its "
                                            f"{timeout:g}s drain timeout; retry it")
    return not waited.cancelled_caught


def _announce(cfg: GatewayConfig, binds: list[str], zmq_addr: str) -> None:
    url = binds[0] if binds else f"http://{cfg.host}:{cfg.port}"
    auth = ' -H "Authorization: Bearer $KVGATE_API_KEY"'
    print(f"kvgate: serving {cfg.model_name!r} at {url}/v1 (workers connect to {zmq_addr})\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{{\"model\": \"{cfg.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)


def _open_tenancy(cfg: TenancyConfig) -> tuple[TenancyStore, ServerSecret, RateLimiter]:
    store, secret = open_store(cfg.db_path)
    limiter: RateLimiter
    if cfg.redis_url:
        from tenancy.redis_limiter import RedisLimiter  # imports redis only when asked for

        limiter = RedisLimiter(cfg.redis_url, time.time, store.scope_tokens_used, fail_open=cfg.redis_fail_open)
    else:
        limiter = Limiter(time.time, store.scope_tokens_used)
    if cfg.demo_tenant:
        _create_demo_tenant(store, cfg.db_path)
    return store, secret, limiter


def _create_demo_tenant(store: TenancyStore, db_path: str) -> None:
    """First start on an empty store: a working key at once, printed once (stdout, never the log)."""
    if store.list_tenants():
        return
    try:
        store.create_tenant("demo")
    except ValueError:
        return  # another gateway starting on the same fresh store won the race; it prints the key
    key_id, plaintext = store.create_key("demo", "created on first start")
    print(f"kvgate: empty store {redact(db_path)}: created tenant 'demo' and API key {key_id}. The key is shown only "
          f"this once:\n  export KVGATE_API_KEY={plaintext}", flush=True)
    log.info("created tenant 'demo' with key %s on an empty store", key_id)


def _lora_context(cfg: GatewayConfig, model_dir: Path) -> LoraContext | None:
    """With --lora-dir (also forwarded to the local workers): where adapters are registered from, and the base
    model's shapes they are checked against. A missing directory is a start-up error, not a 400 on each use."""
    lora_dir = cfg.engine.values.get("lora_dir")
    if lora_dir is None:
        return None
    if not Path(lora_dir).is_dir():
        raise ValueError(f"--lora-dir {lora_dir!r} is not a directory")
    try:
        return LoraContext.load(lora_dir, model_dir)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--lora-dir: the base model's config.json cannot give its shapes ({e!r})") from None


def _lease_holder(cfg: GatewayConfig) -> str:
    """This process among the gateways that may run batches (its log lines name it)."""
    return f"{socket.gethostname()}:{cfg.port}:{os.getpid()}:{secrets.token_hex(4)}"


async def _sweep_uploads(admin: AdapterAdmin, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Tenants' uploaded adapter directories that nothing registers any more, now and every
    ``KVGATE_UPLOAD_SWEEP_S`` seconds (default 300): a tenant suspended or deleted through ``kvgatectl --db``
    loses its registrations at once, but only a gateway can remove the files, and a crash mid-upload leaves one
    behind. ``sweep_uploads`` spares anything younger than its grace period (an upload between its rename and its
    registration). Several gateways on one directory each sweep: removals are idempotent."""
    interval_s = float(os.environ.get("KVGATE_UPLOAD_SWEEP_S", "300"))
    task_status.started()
    while True:
        try:
            await trio.to_thread.run_sync(admin.sweep)
        except Exception:  # a full disk or a store hiccup must not stop the gateway: the next round tries again
            log.exception("sweeping unregistered adapter uploads failed")
        await trio.sleep(interval_s)


def _batch_runner(state: GatewayState) -> BatchRunner:
    cfg, ten = state.config, state.tenancy
    pipe = Pipeline(state.tokenizer, state.pool, ten.quota, state.metrics, state.tracing, cfg.model_name,
                    cfg.timing.request_timeout, batch_priority(cfg.engine.values.get("scheduling_policy")),
                    ten.adapters)
    return BatchRunner(ten.batches, LineRunner(pipe, lambda: state.draining), ten.auth.principal_of,
                       model=cfg.model_name, max_file_lines=cfg.batch.max_file_lines,
                       in_flight=cfg.batch.lines_in_flight, draining=lambda: state.draining)


async def serve(cfg: GatewayConfig, *, handle_signals: bool = True, span_exporter: SpanExporter | None = None,
                task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the gateway until a signal (or ``task_status``'s "stop" event). ``span_exporter`` receives every
    span as it ends, besides the configured OTLP endpoint (embedders and tests)."""
    # Resolving may convert a GGUF in a subprocess (minutes, once): keep the event loop free meanwhile.
    model_dir = await trio.to_thread.run_sync(resolve_model_dir, cfg.model)
    tokenizer = await trio.to_thread.run_sync(GatewayTokenizer, model_dir)
    lora = await trio.to_thread.run_sync(_lora_context, cfg, model_dir)
    store, secret, limiter = await trio.to_thread.run_sync(_open_tenancy, cfg.tenancy)
    ctx: zmq.Context[Any] = zmq.Context()
    worker_auth: WorkerAuth | None = None
    try:
        worker_auth = start_worker_auth(ctx, cfg.worker_security)  # the ZAP handler must exist before the bind
        sock, zmq_addr = gateway_router(ctx, cfg.zmq_bind, curve=worker_auth.server if worker_auth else None)
    except BaseException:
        if worker_auth is not None:
            worker_auth.stop()
        ctx.destroy(linger=0)
        raise
    supervisor: Supervisor | None = None
    tracing = Tracing(cfg.observability.otlp_endpoint, span_exporter)
    try:
        async with trio.open_nursery() as outer:
            tenancy = Tenancy(store, Authenticator(store, secret, ttl=cfg.tenancy.auth_cache_ttl,
                                                   failures_per_minute=cfg.tenancy.auth_failures_per_minute),
                              QuotaGate(limiter), UsageLedger(store.record_usage),
                              StoredResponses(ResponseStore(store.backend,
                                                            cfg.tenancy.responses_retention_days * 86400.0)),
                              StoredBatches(store.backend, _lease_holder(cfg), LEASE_TTL_S),
                              AdapterCatalog(AdapterStore(store.backend) if lora is not None else None,
                                             ttl=cfg.tenancy.auth_cache_ttl))
            await outer.start(tenancy.ledger.run)  # first in, last out: rows of ending requests still land
            await outer.start(tenancy.quota.run)
            await outer.start(tenancy.responses.run)  # prunes expired stored responses
            gm = GatewayMetrics(cfg.model_name)
            pool = WorkerPool(sock, cfg.model_name, cfg.timing, cfg.admission,
                              lambda: supervisor.restart_eta() if supervisor is not None else None, gm)
            if worker_auth is not None:
                pool.identities.authorize = worker_auth.keyring.refusal  # worker ids bound to keys
            await outer.start(pool.run)
            if cfg.workers:
                supervisor = Supervisor(pool, cfg.workers, zmq_addr, model_dir, cfg.model_name, cfg.engine,
                                        cfg.timing, on_restart=lambda wid: gm.restarts.labels(cfg.model_name,
                                                                                              wid).inc(),
                                        log_format=cfg.observability.log_format,
                                        extra_env=worker_auth.local_worker_env() if worker_auth else None)
                pool.kill_local = supervisor.kill  # a frozen or hung local worker is killed and restarted
                if worker_auth is not None:
                    worker_auth.keyring.local_ids = frozenset(supervisor.worker_ids())
                await outer.start(supervisor.run)
            state = GatewayState(cfg, tokenizer, pool, tenancy, gm, tracing, lora=lora)
            if lora is not None:  # uploads left unregistered, at start and then periodically
                await outer.start(_sweep_uploads, AdapterAdmin(tenancy.store, lora))
            await outer.start(_batch_runner(state).run)  # runs batches while this gateway holds the lease
            app = create_app(state)
            stop = trio.Event()
            hc = _hypercorn_config(cfg)
            async with trio.open_nursery() as http:
                if handle_signals:
                    http.start_soon(_wait_for_signal, stop, state, hc)

                async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                    await hypercorn.trio.serve(app, hc, shutdown_trigger=stop.wait,
                                               task_status=task_status)
                    http.cancel_scope.cancel()  # Hypercorn is done: stop waiting for signals

                binds = await http.start(run_http)
                _announce(cfg, binds, zmq_addr)
                task_status.started({"binds": binds, "zmq": zmq_addr, "pool": pool, "supervisor": supervisor,
                                     "stop": stop})
            with trio.CancelScope(shield=True):
                await pool.shutdown_workers(supervisor.worker_ids() if supervisor is not None else set())
            outer.cancel_scope.cancel()  # the supervisor terminates its workers in shielded cleanup
    finally:
        tracing.shutdown()
        sock.close()
        if worker_auth is not None:
            worker_auth.stop()
        ctx.term()
        limiter.close()
        store.close()
