"""The worker's socket I/O, in a thread of its own beside the engine loop.

Step time is not a liveness signal: one prefill chunk can take seconds on a slow CPU (or a large model on a
GPU), and a heartbeat that waits for the step to end makes a busy worker look dead. So, as vLLM's engine-core
process does with its input and output threads, the ZeroMQ DEALER belongs to one I/O thread that

* receives gateway messages at any time and queues them for the engine, which applies them at its next step
  boundary (``take``);
* sends the engine's step outputs as soon as a step ends (``send``: the engine thread hands encoded frames over
  an inproc PUSH/PULL pair, which also wakes the I/O thread at once);
* sends a Stats heartbeat every ``stats_interval`` whatever the engine is doing, from the snapshot the engine
  published at its last step boundary plus how long the current step has run (``StepClock``);
* watches the connection (re-Hello after a reconnect) and the parent process, and tells the engine to stop
  when the gateway is gone for good.

Only the I/O thread touches the DEALER and the monitor socket; only the engine thread touches the PUSH
socket; the two share immutable snapshots and plain attributes (single assignments, atomic under the GIL).
The engine core itself stays synchronous and knows nothing of this.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.codec import decode_or_none, encode
from ipc.messages import GatewayToWorker, Hello, Message, Stats
from workers.core.outputs import EngineStats

log = logging.getLogger("kvgate.worker.io")

STATS_INTERVAL_S: Final = 0.5
# A worker the gateway started (it has --parent-pid) disconnected this long, reconnects included: its gateway is
# not coming back. A worker started by hand never gives up: it outlives a gateway restart, however long, and
# re-introduces itself to the next gateway on the address (ARCHITECTURE.md, README "Remote workers").
GATEWAY_GONE_S: Final = 5.0
# Gateway messages waiting for the engine's next step boundary. Past it the I/O thread stops reading the
# socket, so the DEALER's receive high-water mark pushes back on the gateway instead of this queue growing.
INBOX_BOUND: Final = 4096
# Step outputs handed from the engine thread to the I/O thread. When the gateway stops reading, these fill
# and the engine's send blocks: backpressure reaches the engine instead of memory growing without bound.
OUTBOX_HWM: Final = 256
_RECV_BATCH: Final = 256  # socket reads per wake-up, so a flood cannot starve heartbeats
REFUSED: Final = "refused by the gateway"  # a failed handshake (CURVE key or settings): retrying cannot help
_HANDSHAKE_FAILED: Final[dict[int, str]] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the gateway refused this worker's CURVE key (not among its --worker-keys)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "CURVE handshake failed: is --server-key the gateway's public key?",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: one side uses CURVE and the other does not "
                                         "(--key/--server-key here, --worker-keys on the gateway)",
}


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine looked like at its last step boundary (published by the engine thread)."""

    stats: EngineStats
    request_ids: tuple[str, ...]
    max_num_batched_tokens: int  # the step's token budget


@dataclass(frozen=True, slots=True)
class StopRequest:
    """Queued for the engine by the I/O thread: leave the loop (the gateway is gone or we were orphaned)."""

    reason: str


class StepClock:
    """Step progress shared by the two threads: written by the engine thread, read by the I/O thread."""

    def __init__(self) -> None:
        self.steps_done = 0
        self.step_started: float | None = None  # time.monotonic() at the start of the running step

    def begin(self) -> None:
        self.step_started = time.monotonic()

    def end(self) -> None:
        self.steps_done += 1
        self.step_started = None

    def elapsed(self) -> float | None:
        started = self.step_started  # one read: the engine thread may clear it meanwhile
        return None if started is None else max(0.0, time.monotonic() - started)


class WorkerIO:
    """Owns the DEALER in a thread of its own; the engine thread uses ``take``, ``send``, ``publish``."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[bytes], hello: Hello,
                 parent_pid: int | None, stats_interval: float = STATS_INTERVAL_S) -> None:
        self.sock, self.hello, self.parent_pid = sock, hello, parent_pid
        self.stats_interval = stats_interval
        self.clock = StepClock()
        self.inbox: queue.Queue[GatewayToWorker | StopRequest] = queue.Queue(maxsize=INBOX_BOUND)
        self.snapshot: EngineSnapshot | None = None
        addr = f"inproc://kvgate-worker-out-{id(self)}"
        self._pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, OUTBOX_HWM)
        self._pull.bind(addr)
        self._push: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, OUTBOX_HWM)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        for failed in _HANDSHAKE_FAILED:
            events |= failed
        self._monitor: zmq.Socket[bytes] = sock.get_monitor_socket(events)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgate-worker-io", daemon=True)
        # The first CONNECTED event may predate the monitor; the initial Hello's send timeout covers a
        # gateway that is unreachable from the start.
        self._disconnected_since: float | None = None
        self._pending: bytes | None = None  # an outgoing frame the DEALER could not take yet
        self._stop_sent = False

    # ---- engine-thread API --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def take(self, timeout: float) -> list[GatewayToWorker | StopRequest]:
        """Everything queued, waiting up to ``timeout`` seconds for the first item (0: don't wait)."""
        items: list[GatewayToWorker | StopRequest] = []
        try:
            items.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def has_messages(self) -> bool:
        """Whether something waits for ``take`` (an idle-time probe gives way to it)."""
        return not self.inbox.empty()

    def send(self, msg: Message) -> None:
        """Hand a message to the I/O thread; blocks while OUTBOX_HWM frames wait (backpressure)."""
        self._push.send(encode(msg))

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def close(self, final: Message | None = None, timeout: float = 1.0) -> None:
        """Stop the thread (after it flushed what the engine sent, and ``final``), then close our sockets."""
        if final is not None:
            try:  # never block the exit on a full outbox or a dead I/O thread
                self._push.send(encode(final), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("could not queue %s on the way out", type(final).__name__)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout + 1.0)
        self._push.close(linger=0)

    # ---- the I/O thread -----------------------------------------------------------------------

    def stats(self) -> Stats:
        snap = self.snapshot
        s = snap.stats if snap is not None else EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)
        ids = list(snap.request_ids) if snap is not None else []
        return Stats(self.hello.worker_id, s.num_running, s.num_waiting, s.kv_usage, s.num_free_blocks,
                     s.num_total_blocks, s.num_preemptions, s.prefix_queries, s.prefix_hits,
                     s.prompt_tokens_total, s.generation_tokens_total, time.time(), self.clock.steps_done,
                     self.clock.elapsed(), ids, s.spec_num_drafts, s.spec_num_draft_tokens,
                     s.spec_num_accepted_tokens, list(s.spec_accepted_per_pos),
                     snap.max_num_batched_tokens if snap is not None else self.hello.max_num_batched_tokens)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must stop the worker, not leave an engine nobody can reach
            log.exception("worker I/O thread failed")
            self._ask_engine_to_stop("I/O thread failed")
        finally:
            self._flush(deadline=time.monotonic() + 1.0)
            self._pull.close(linger=0)
            self._monitor.close(linger=0)

    def _loop(self) -> None:
        next_stats = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + self.stats_interval
                self._heartbeat()
            wait_ms = max(0, int((next_stats - time.monotonic()) * 1000))
            ready = dict(self._poller().poll(min(wait_ms, 100)))  # wake at least every 100 ms to see _stop
            if self._monitor in ready:
                self._watch_connection()
            if self.sock in ready:
                self._forward_pending()
                if ready[self.sock] & zmq.POLLIN:
                    self._receive()
            if self._pull in ready and self._pending is None:
                self._pending = self._pull.recv()
                self._forward_pending()

    def _poller(self) -> zmq.Poller:
        # Read the socket only while the engine's queue has room; wait for POLLOUT only with a frame pending;
        # take the engine's next frame only once the last one left.
        poller = zmq.Poller()
        flags = (zmq.POLLIN if not self.inbox.full() else 0) | (zmq.POLLOUT if self._pending is not None else 0)
        if flags:
            poller.register(self.sock, flags)
        if self._pending is None:
            poller.register(self._pull, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        return poller

    def _forward_pending(self) -> None:
        """Move step outputs to the DEALER without blocking (heartbeats must never wait behind them)."""
        while self._pending is not None:
            try:
                self.sock.send(self._pending, flags=zmq.NOBLOCK)
            except zmq.Again:
                return  # the gateway's pipe is full or it is not connected: retry on POLLOUT
            try:
                self._pending = self._pull.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                self._pending = None

    def _receive(self) -> None:
        for _ in range(_RECV_BATCH):
            if self.inbox.full():
                return
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_or_none(frames[0], peer="gateway", logger=log) if len(frames) == 1 else None
            if isinstance(msg, GatewayToWorker):
                self.inbox.put_nowait(msg)
            else:
                log.warning("dropping a frame from the gateway that is not a gateway->worker message")

    def _heartbeat(self) -> None:
        gone = (self.parent_pid is not None and self._disconnected_since is not None
                and time.monotonic() - self._disconnected_since > GATEWAY_GONE_S)
        if gone or (self.parent_pid is not None and os.getppid() != self.parent_pid):
            self._ask_engine_to_stop("gateway gone")
            return
        try:  # a heartbeat that cannot leave now is dropped: the next one carries fresher figures anyway
            self.sock.send(encode(self.stats()), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _watch_connection(self) -> None:
        """Re-introduce ourselves after a reconnect (a restarted gateway knows nothing of us)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                if self._disconnected_since is not None:
                    try:
                        self.sock.send(encode(self.hello), flags=zmq.NOBLOCK)
                    except zmq.Again:
                        log.warning("could not re-send Hello after reconnecting")
                self._disconnected_since = None
            elif event == zmq.EVENT_DISCONNECTED and self._disconnected_since is None:
                self._disconnected_since = time.monotonic()
            elif event in _HANDSHAKE_FAILED:
                log.error("%s; exiting", _HANDSHAKE_FAILED[event], extra={"fields": {"event": "handshake_failed"}})
                self._ask_engine_to_stop(REFUSED)

    def _ask_engine_to_stop(self, reason: str) -> None:
        if self._stop_sent:
            return
        try:
            self.inbox.put_nowait(StopRequest(reason))
            self._stop_sent = True
        except queue.Full:
            pass  # retried at the next heartbeat, once the engine has taken some of its queue

    def _flush(self, deadline: float) -> None:
        """On the way out: let queued outputs (and a final Goodbye) leave, bounded in time."""
        while time.monotonic() < deadline:
            if self._pending is None:
                try:
                    self._pending = self._pull.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    return
            self._forward_pending()
            if self._pending is not None and not self.sock.poll(50, zmq.POLLOUT):
                continue
