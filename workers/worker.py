"""Worker process: one engine replica behind a ZeroMQ DEALER, driven by the gateway.

The loop is synchronous: between engine steps it drains the socket (aborts are applied before the next
step), then runs one step and sends its outputs as one StepOutputs frame; a Stats heartbeat goes out every
0.5 s. It exits by itself when its parent process dies or the gateway has been gone for a while, so no
worker outlives a SIGKILLed gateway.

    python -m workers.worker --connect tcp://127.0.0.1:5555 --worker-id w0 --model smollm2
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.messages import (PROTOCOL_VERSION, Abort, Drain, EngineTimings, Generate, GatewayToWorker, Goodbye,
                          Hello, RequestError, RequestOutputMsg, Shutdown, Stats, StepOutputs)
from ipc.sync_transport import drain_incoming, send, worker_dealer
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.outputs import StepOutput
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import SchedulerConfig
from workers.engine import LLMEngine, engine_from_config
from workers.logs import FORMATS, setup_logging
from workers.startup import StartupProgress

log = logging.getLogger("kvgate.worker")
STATS_INTERVAL_S = 0.5
GATEWAY_GONE_S = 5.0  # disconnected this long (reconnects included) means the gateway is not coming back
IDLE_POLL_MS = 50


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine knobs shared by ``kvgate worker`` and ``kvgate serve``."""
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or safetensors directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(ModelConfig(a.model, a.device, a.dtype, a.max_model_len, a.seed),
                        CacheConfig(a.block_size, a.kv_cache_tokens, 0.9, not a.no_prefix_caching, a.kv_cache_dtype),
                        SchedulerConfig(a.max_num_seqs, a.max_num_batched_tokens))


def to_msg(o: StepOutput) -> RequestOutputMsg:
    t = o.timings
    timings = None if t is None else EngineTimings(t.scheduled, t.first_token, t.finished, list(t.preempted))
    return RequestOutputMsg(o.request_id, list(o.new_token_ids), o.finish_reason, o.num_cached_tokens,
                            o.logprobs, o.error, timings)


class Worker:
    """Owns the engine, the socket and the deadlines of the requests it runs."""

    def __init__(self, engine: LLMEngine, sock: zmq.Socket[bytes], worker_id: str, model_name: str,
                 parent_pid: int | None) -> None:
        self.engine, self.sock, self.worker_id = engine, sock, worker_id
        self.model_name, self.parent_pid = model_name, parent_pid
        self.deadlines: dict[str, float] = {}  # request id -> unix deadline
        self.draining = False
        self.stopping = False
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        # The first CONNECTED event may predate the monitor; the initial Hello's send timeout covers a
        # gateway that is unreachable from the start.
        self.disconnected_since: float | None = None

    def hello(self) -> Hello:
        e, bm = self.engine, self.engine.scheduler.bm
        return Hello(PROTOCOL_VERSION, self.worker_id, os.getpid(), self.model_name, e.max_model_len,
                     bm.block_size, bm.num_blocks, e.vocab_size, sorted(e.eos_token_ids))

    def stats(self) -> Stats:
        s = self.engine.stats()
        return Stats(self.worker_id, s.num_running, s.num_waiting, s.kv_usage, s.num_free_blocks,
                     s.num_total_blocks, s.num_preemptions, s.prefix_queries, s.prefix_hits,
                     s.prompt_tokens_total, s.generation_tokens_total, time.time())

    def handle(self, msg: GatewayToWorker) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.request_ids)
            for rid in msg.request_ids:
                self.deadlines.pop(rid, None)
        elif isinstance(msg, Drain):
            self.draining = True
        elif isinstance(msg, Shutdown):
            self.engine.abort(list(self.engine.scheduler.requests))
            self.stopping = True

    def _generate(self, g: Generate) -> None:
        if self.draining:
            send(self.sock, RequestError(g.request_id, "worker is draining", "draining"))
            return
        try:
            params = SamplingParams.from_dict(dict(g.sampling))
            self.engine.add_request(g.request_id, g.prompt_token_ids, params, g.cache_salt, g.weight)
        except (ValueError, TypeError) as e:  # bad input: a 4xx for that request, never a dead worker
            send(self.sock, RequestError(g.request_id, str(e), "invalid_request"))
            return
        if g.deadline is not None:
            self.deadlines[g.request_id] = g.deadline

    def _expire(self) -> None:
        now = time.time()
        late = [rid for rid, d in self.deadlines.items() if d <= now]
        if late:
            self.engine.abort(late)
            for rid in late:
                del self.deadlines[rid]

    def _watch_connection(self) -> bool:
        """Track connect/disconnect events; re-introduce ourselves after a reconnect (a restarted gateway
        knows nothing of us). Returns False when the gateway has been gone too long."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                if self.disconnected_since is not None:
                    send(self.sock, self.hello(), timeout_ms=1000)
                self.disconnected_since = None
            elif event == zmq.EVENT_DISCONNECTED and self.disconnected_since is None:
                self.disconnected_since = time.monotonic()
        gone = self.disconnected_since is not None and time.monotonic() - self.disconnected_since > GATEWAY_GONE_S
        orphaned = self.parent_pid is not None and os.getppid() != self.parent_pid
        return not (gone or orphaned)

    def run(self) -> str:
        next_stats = 0.0
        while True:
            busy = self.engine.has_unfinished()
            for msg in drain_incoming(self.sock, 0 if busy else IDLE_POLL_MS):
                self.handle(msg)
            if self.stopping:
                return "shutdown"
            self._expire()
            if self.engine.has_unfinished():
                outs = self.engine.step()
                tokens = self.engine.last_num_batched_tokens
                if outs or tokens:  # a prefill chunk that sampled nothing still counts as an iteration
                    send(self.sock, StepOutputs([to_msg(o) for o in outs], tokens))
                    for o in outs:
                        if o.finished:
                            self.deadlines.pop(o.request_id, None)
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_INTERVAL_S
                if not self._watch_connection():
                    return "gateway gone"
                send(self.sock, self.stats(), timeout_ms=1000)
            if self.draining and not self.engine.has_unfinished():
                return "drained"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate worker", description="run one engine replica")
    p.add_argument("--connect", required=True, help="the gateway's ZeroMQ address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--worker-id", default=f"worker-{os.getpid()}")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    p.add_argument("--log-format", default="json", choices=FORMATS, help="JSON lines (default) or readable text")
    add_engine_args(p)
    a = p.parse_args(argv)
    setup_logging("INFO", a.log_format)
    progress = StartupProgress(f"worker {a.worker_id}")
    engine, _ = engine_from_config(engine_config(a), progress)
    bm = engine.scheduler.bm
    progress.done(f"ready: {bm.num_blocks} KV blocks of {bm.block_size} tokens, max_model_len {engine.max_model_len}")
    ctx: zmq.Context[Any] = zmq.Context()
    sock = worker_dealer(ctx, a.connect, a.worker_id)
    w = Worker(engine, sock, a.worker_id, a.served_model_name or a.model, a.parent_pid)
    try:
        send(sock, w.hello(), timeout_ms=10_000)
        reason = w.run()
        log.info("worker %s exiting: %s", a.worker_id, reason)
        if reason != "gateway gone":
            send(sock, Goodbye(a.worker_id, reason), timeout_ms=1000)
    except TimeoutError:
        log.warning("worker %s: gateway unreachable, exiting", a.worker_id)
    except KeyboardInterrupt:
        pass
    finally:
        w.monitor.close(linger=0)
        sock.close(linger=1000)  # let a queued Goodbye leave; bounded so a vanished gateway cannot hold us
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
