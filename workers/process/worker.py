"""Worker process: one engine replica behind a ZeroMQ DEALER, driven by the gateway.

Two threads (see ``workers.process.worker_io``): the I/O thread owns the socket, so heartbeats leave on time
and gateway messages arrive while a step runs; the engine thread (this module's loop) applies what arrived at
each step boundary (aborts before the next step), runs one step and hands its outputs over at once. The
worker exits by itself when its parent process dies or the gateway has been gone for a while, so no worker
outlives a SIGKILLed gateway.

    python -m workers.process.worker --connect tcp://127.0.0.1:5555 --worker-id w0 --model smollm2
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq

from ipc.messages import (PROTOCOL_VERSION, Abort, Drain, EngineTimings, Generate, GatewayToWorker, Goodbye,
                          Hello, Refused, RequestError, RequestOutputMsg, Shutdown)
from ipc.curve import SECRET_SUFFIX, ClientCurve, client_curve
from ipc.sync_transport import send, worker_dealer
from workers.process import step_sizing
from workers.core.outputs import StepOutput
from workers.engine import LLMEngine
from workers.engine_build import engine_from_config
from workers.process.step_frames import step_frames
from common.logs import FORMATS, setup_logging
from common.startup import StartupProgress
from workers.process.worker_args import add_engine_args, engine_config
from workers.process.worker_io import REFUSED, EngineSnapshot, StopRequest, WorkerIO

log = logging.getLogger("kvgate.worker")
IDLE_WAIT_S = 1.0  # an idle engine sleeps on its inbox; a message wakes it at once


def to_msg(o: StepOutput) -> RequestOutputMsg:
    t = o.timings
    timings = None if t is None else EngineTimings(t.scheduled, t.first_token, t.finished, list(t.preempted))
    return RequestOutputMsg(o.request_id, list(o.new_token_ids), o.finish_reason, o.num_cached_tokens,
                            o.logprobs, o.error, timings, o.error_code, o.prompt_logprobs)


class Worker:
    """The engine thread: owns the engine and the deadlines of the requests it runs."""

    def __init__(self, engine: LLMEngine, io: WorkerIO, step_delay: float = 0.0,
                 resizer: step_sizing.Resizer | None = None) -> None:
        self.engine, self.io = engine, io
        self.resizer = resizer  # sizes the steps again while idle (None: the operator fixed the budget)
        self.step_delay = step_delay  # test and drill hook (--debug-step-delay): a slow machine on demand
        self.deadlines: dict[str, float] = {}  # request id -> unix deadline
        self.draining = False
        self.stopping: str | None = None  # why the loop must end, once it must

    def handle(self, msg: GatewayToWorker | StopRequest) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, Abort):
            self.engine.abort(msg.request_ids)
            for rid in msg.request_ids:
                self.deadlines.pop(rid, None)
        elif isinstance(msg, Drain):
            self.draining = True
        elif isinstance(msg, Refused):
            log.error("the gateway refused this worker: %s; exiting", msg.reason,
                      extra={"fields": {"event": "worker_refused"}})
            self.engine.abort(list(self.engine.scheduler.requests))
            self.stopping = REFUSED
        elif isinstance(msg, Shutdown):
            self.engine.abort(list(self.engine.scheduler.requests))
            self.stopping = "shutdown"
        elif isinstance(msg, StopRequest):
            self.stopping = msg.reason

    def _generate(self, g: Generate) -> None:
        if self.draining:
            self.io.send(RequestError(g.request_id, "worker is draining", "draining"))
            return
        try:
            # g.sampling was validated when the frame was decoded (ipc.codec): no second check here
            self.engine.add_request(g.request_id, g.prompt_token_ids, g.sampling, g.cache_salt, g.weight,
                                    priority=g.priority, lora=g.lora)
        except (ValueError, TypeError) as e:  # bad input: a 4xx for that request, never a dead worker
            self.io.send(RequestError(g.request_id, str(e), "invalid_request"))
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

    def publish(self) -> None:
        self.io.publish(EngineSnapshot(self.engine.stats(), tuple(self.engine.scheduler.requests),
                                       self.engine.scheduler.config.max_num_batched_tokens))

    def step(self) -> None:
        clock = self.io.clock
        clock.begin()
        try:
            if self.step_delay and self.engine.scheduler.requests:  # a step with work, not only reports
                _hold_the_gil(self.step_delay)
            outs = self.engine.step()
        finally:
            clock.end()
        tokens = self.engine.last_num_batched_tokens
        if outs or tokens:  # a prefill chunk that sampled nothing still counts as an iteration
            # in frames of bounded size: a big step's encode (GIL held) and the gateway's decode stay short
            for frame in step_frames([to_msg(o) for o in outs], tokens):
                self.io.send(frame)
            for o in outs:
                if o.finished:
                    self.deadlines.pop(o.request_id, None)

    def run(self) -> str:
        self.publish()
        active = time.monotonic()  # the last step or message: idle time is measured from here
        while True:
            busy = self.engine.has_unfinished()
            # Idle: sleep until the gateway says something (the I/O thread keeps the heartbeats going).
            msgs = self.io.take(0 if busy else IDLE_WAIT_S)
            for msg in msgs:
                self.handle(msg)
            if self.stopping is not None:
                return self.stopping
            self._expire()
            if msgs:  # heartbeats during the next step must already show what these changed (aborts)
                self.publish()
            if self.engine.has_unfinished():
                self.step()
                self.publish()
            elif not msgs:
                self._resize(time.monotonic() - active)
            if msgs or self.engine.has_unfinished():
                active = time.monotonic()
            if self.draining and not self.engine.has_unfinished():
                return "drained"

    def _resize(self, idle_s: float) -> None:
        """While idle, size the steps again if it is time (step_sizing.Resizer); a message stops the probes."""
        if self.resizer is None or self.draining:
            return
        sizing = self.resizer.maybe_run(self.engine, idle_s, self.io.has_messages)
        if sizing is not None:
            self.publish()  # the next heartbeat carries the new budget
            _log_sizing(sizing, "step budget now %d tokens", self.resizer.times, self.resizer.pending)


def _hold_the_gil(seconds: float) -> None:
    """Spin in Python for ``seconds``: a step as slow as a slow machine's, holding the GIL the way Python
    code between torch ops does (the I/O thread gets it only at the interpreter's switch interval)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _size_steps(engine: LLMEngine, a: argparse.Namespace,
                progress: StartupProgress) -> tuple[int, step_sizing.Resizer | None]:
    """The step's token budget: the operator's, or measured so a step stays under --target-step-ms (and then the
    Resizer that measures again while the worker is idle)."""
    if a.max_num_batched_tokens is not None:
        step_sizing.apply(engine, a.max_num_batched_tokens)
        return int(a.max_num_batched_tokens), None
    target = a.target_step_ms if a.target_step_ms is not None else step_sizing.default_target_ms(a.device)
    with progress.step(f"sizing steps to the machine (target {target:.0f} ms)"):
        sizing, times = step_sizing.measure(engine, target, a.max_num_seqs)
    step_sizing.apply(engine, sizing.max_num_batched_tokens)
    _log_sizing(sizing, "step budget %d tokens", times, times.contended)
    return sizing.max_num_batched_tokens, step_sizing.Resizer(sizing, times, a.max_num_seqs)


def _log_sizing(sizing: step_sizing.StepSizing, what: str, times: step_sizing.ProbeTimes, again: bool) -> None:
    """``times``: the last probes' (what other processes used meanwhile); ``again``: whether rounds will follow."""
    share = "an unknown share" if times.others is None else f"{times.others:.0%}"
    busy = f"; other processes used {share} of the CPUs meanwhile" + (": sizing again when idle" if again else "")
    log.info(what + " (measured: %.1f ms per step + %.3f ms per prefill token; target %.0f ms%s)",
             sizing.max_num_batched_tokens, sizing.fixed_ms, sizing.per_token_ms, sizing.target_ms, busy,
             extra={"fields": {"event": "step_sizing", "max_num_batched_tokens": sizing.max_num_batched_tokens,
                               "fixed_ms": round(sizing.fixed_ms, 2), "per_token_ms": round(sizing.per_token_ms, 4),
                               "target_step_ms": sizing.target_ms,
                               "others_cpu_share": None if times.others is None else round(times.others, 3)}})


def hello_for(engine: LLMEngine, worker_id: str, model_name: str) -> Hello:
    bm, cfg = engine.scheduler.bm, engine.scheduler.config
    return Hello(PROTOCOL_VERSION, worker_id, os.getpid(), model_name, engine.max_model_len, bm.block_size,
                 bm.num_blocks, engine.vocab_size, sorted(engine.eos_token_ids), cfg.max_num_seqs,
                 cfg.max_num_batched_tokens)


def default_worker_id(key_file: str | None) -> str:
    """worker-PID; with a key file NAME.key_secret, NAME/PID: an id that key may serve (worker_auth)."""
    if key_file is None:
        return f"worker-{os.getpid()}"
    name = Path(key_file).name
    return f"{name.removesuffix(SECRET_SUFFIX) if name.endswith(SECRET_SUFFIX) else Path(name).stem}/{os.getpid()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate worker", description="run one engine replica")
    p.add_argument("--connect", required=True, help="the gateway's ZeroMQ address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--worker-id", default=None,
                   help="this worker's id (default: worker-PID; with --key NAME.key_secret: NAME/PID, as the "
                        "gateway lets key NAME serve ids NAME and NAME/*)")
    p.add_argument("--server-key", default=None, metavar="FILE",
                   help="the gateway's public key file (NAME.key): join over ZeroMQ CURVE (with --key)")
    p.add_argument("--key", default=None, metavar="FILE", help="this worker's secret key file (NAME.key_secret)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    p.add_argument("--log-format", default="json", choices=FORMATS, help="JSON lines (default) or readable text")
    # Tests and chaos drills make a worker as slow as a slow machine's: every step spins this long first.
    p.add_argument("--debug-step-delay", type=float, default=float(os.environ.get("KVGATE_DEBUG_STEP_DELAY", 0)),
                   help=argparse.SUPPRESS)
    add_engine_args(p)
    a = p.parse_args(argv)
    if a.worker_id is None:
        a.worker_id = default_worker_id(a.key)
    setup_logging("INFO", a.log_format)
    try:  # before the model loads: a wrong key file is a quick error, not one after minutes
        curve = client_curve(a.key, a.server_key, os.environ)
    except ValueError as e:
        p.error(str(e))
    try:
        cfg = engine_config(a)
    except ValueError as e:  # a flag out of range: a usage error naming it, before the model loads
        p.error(str(e))
    progress = StartupProgress(f"worker {a.worker_id}")
    engine, _ = engine_from_config(cfg, progress)
    budget, resizer = _size_steps(engine, a, progress)
    bm = engine.scheduler.bm
    progress.done(f"ready: {bm.num_blocks} KV blocks of {bm.block_size} tokens, max_model_len "
                  f"{engine.max_model_len}, step budget {budget} tokens")
    return _serve(engine, a, curve, resizer)


def _serve(engine: LLMEngine, a: argparse.Namespace, curve: ClientCurve | None = None,
           resizer: step_sizing.Resizer | None = None) -> int:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = worker_dealer(ctx, a.connect, a.worker_id, curve=curve)
    if curve is not None:
        log.info("worker %s joins %s over CURVE, public key %s", a.worker_id, a.connect, curve.keys.public.decode())
    io = WorkerIO(ctx, sock, hello_for(engine, a.worker_id, a.served_model_name or a.model), a.parent_pid)
    final: Goodbye | None = None
    status = 0
    try:
        send(sock, io.hello, timeout_ms=10_000)  # before the I/O thread owns the socket
        io.start()
        reason = Worker(engine, io, a.debug_step_delay, resizer).run()
        log.info("worker %s exiting: %s", a.worker_id, reason)
        if reason == REFUSED:
            status = 1  # a supervisor (systemd, Kubernetes) sees the failure; restarting will not fix a key
        elif reason != "gateway gone":
            final = Goodbye(a.worker_id, reason)
    except TimeoutError:
        log.warning("worker %s: gateway unreachable, exiting", a.worker_id)
    except KeyboardInterrupt:
        pass
    finally:
        io.close(final)  # lets queued outputs and the Goodbye leave, bounded in time
        sock.close(linger=1000)
        ctx.term()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
