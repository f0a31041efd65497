"""Run a whole gateway: the worker pool on its ROUTER, the local worker supervisor, and Hypercorn (trio).

Lifecycle as nested nurseries: the outer one holds the pool and the supervisor, the inner one the HTTP
server. SIGINT/SIGTERM stops the HTTP server (Hypercorn gives in-flight responses ``graceful_timeout``),
then the workers are told to shut down and the outer nursery is cancelled, which terminates (then kills)
every local worker. Nothing outlives ``serve``.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import hypercorn.trio
import trio
import zmq
from hypercorn.config import Config as HyperConfig

from gateway.app import GatewayState, create_app
from gateway.config import GatewayConfig
from gateway.pool import WorkerPool
from gateway.supervisor import Supervisor
from gateway.tokenizer import GatewayTokenizer, resolve_model_dir
from ipc.transport import gateway_router

log = logging.getLogger("kvgate.gateway.server")

GRACEFUL_TIMEOUT_S = 5.0


def _hypercorn_config(cfg: GatewayConfig) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S  # deliberate: the default 3 s would cut streams on SIGTERM
    hc.accesslog = None  # request lines carry no prompt, but per-request logging is the tracing issue's job
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def _wait_for_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            stop.set()
            return


def _announce(cfg: GatewayConfig, binds: list[str], zmq_addr: str) -> None:
    url = binds[0] if binds else f"http://{cfg.host}:{cfg.port}"
    auth = f' -H "Authorization: Bearer $KVGATE_API_KEY"' if cfg.api_key else ""
    print(f"kvgate: serving {cfg.model_name!r} at {url}/v1 (workers connect to {zmq_addr})\n"
          f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d '{{\"model\": \"{cfg.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
          flush=True)


async def serve(cfg: GatewayConfig, *, handle_signals: bool = True,
                task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED) -> None:
    # Resolving may convert a GGUF in a subprocess (minutes, once): keep the event loop free meanwhile.
    model_dir = await trio.to_thread.run_sync(resolve_model_dir, cfg.model)
    tokenizer = await trio.to_thread.run_sync(GatewayTokenizer, model_dir)
    ctx: zmq.Context[Any] = zmq.Context()
    sock, zmq_addr = gateway_router(ctx, cfg.zmq_bind)
    supervisor: Supervisor | None = None
    try:
        async with trio.open_nursery() as outer:
            pool = WorkerPool(sock, cfg.model_name, cfg.timing, cfg.admission,
                              lambda: supervisor.restart_eta() if supervisor is not None else None)
            await outer.start(pool.run)
            if cfg.workers:
                supervisor = Supervisor(pool, cfg.workers, zmq_addr, model_dir, cfg.model_name, cfg.engine,
                                        cfg.timing)
                await outer.start(supervisor.run)
            app = create_app(GatewayState(cfg, tokenizer, pool))
            stop = trio.Event()
            async with trio.open_nursery() as http:
                if handle_signals:
                    http.start_soon(_wait_for_signal, stop)

                async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
                    await hypercorn.trio.serve(app, _hypercorn_config(cfg), shutdown_trigger=stop.wait,
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
        sock.close()
        ctx.term()
