"""The worker process over real ZeroMQ: a plain ROUTER in the test plays the gateway."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from ipc.codec import decode, encode
from ipc.messages import Abort, Generate, Hello, Message, RequestError, Shutdown, Stats, StepOutputs
from ipc.sampling import SamplingParams
from tests.tiny_model_dir import make_tiny_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


class FakeGateway:
    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer = b""

    def recv(self, timeout_s: float = 30.0, skip_stats: bool = True) -> Message:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sock.poll(100):
                peer, frame = self.sock.recv_multipart()
                self.peer = peer
                msg = decode(frame)
                if not (skip_stats and isinstance(msg, Stats)):
                    return msg
        raise TimeoutError("no message from the worker")

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.peer, encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _worker(tiny_dir: Path) -> Iterator[tuple[FakeGateway, subprocess.Popen[bytes]]]:
    gw = FakeGateway()
    proc = subprocess.Popen([sys.executable, "-m", "workers.process.worker", "--connect", gw.addr, "--worker-id", "w0",
                             "--model", str(tiny_dir), "--kv-cache-tokens", "2048", "--block-size", "4",
                             "--quantization", "none"])  # fp32: compared with the offline engine below
    try:
        hello = gw.recv(timeout_s=120)
        assert isinstance(hello, Hello) and hello.worker_id == "w0" and hello.num_kv_blocks == 512
        yield gw, proc
    finally:
        proc.kill()
        proc.wait()
        gw.close()


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[tuple[FakeGateway, subprocess.Popen[bytes]]]:
    """Shared by the tests that only send requests: each uses request ids of its own and waits for every one of
    them to end, so none is left running into the next test or mistaken for another's."""
    yield from _worker(tiny_dir)


@pytest.fixture
def own_worker(tiny_dir: Path) -> Iterator[tuple[FakeGateway, subprocess.Popen[bytes]]]:
    """A worker of its own, for a test that shuts it down."""
    yield from _worker(tiny_dir)


def collect(gw: FakeGateway, rid: str) -> tuple[list[int], str | None]:
    toks: list[int] = []
    while True:
        msg = gw.recv()
        assert isinstance(msg, StepOutputs)
        for o in msg.outputs:
            if o.request_id == rid:
                toks.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    return toks, o.finish_reason


def test_generate_matches_offline_engine(worker, tiny_dir: Path) -> None:  # type: ignore[no-untyped-def]
    gw, _ = worker
    prompt = list(range(100, 140))
    gw.send(Generate("r1", prompt, GREEDY, None, 1.0, None, None))
    toks, reason = collect(gw, "r1")
    from workers.llm import LLM

    offline = LLM(str(tiny_dir), kv_cache_tokens=2048, block_size=4, quantization="none")
    [ref] = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert toks == ref.token_ids and reason == "length"


def test_bad_request_is_an_error_not_a_crash(worker) -> None:  # type: ignore[no-untyped-def]
    gw, proc = worker
    gw.send(Generate("bad", [10**9], GREEDY, None, 1.0, None, None))
    err = gw.recv()
    assert isinstance(err, RequestError) and err.request_id == "bad" and err.code == "invalid_request"
    frame = msgpack.unpackb(encode(Generate("bad2", [5], GREEDY, None, 1.0, None, None)))
    frame[3][1] = -1.0  # temperature: no SamplingParams can hold it, only a hand-made frame
    gw.sock.send_multipart([gw.peer, msgpack.packb(frame)])  # fails decode: dropped unanswered (collect below)
    gw.sock.send_multipart([gw.peer, b"\xc1garbage"])  # malformed frame: dropped, worker lives on
    gw.send(Generate("ok", [5, 6, 7], GREEDY, None, 1.0, None, None))
    toks, _ = collect(gw, "ok")
    assert len(toks) == 8 and proc.poll() is None


def test_abort_frees_kv_and_deadline_expires(worker) -> None:  # type: ignore[no-untyped-def]
    gw, _ = worker
    long = dataclasses.replace(GREEDY, max_tokens=2000)
    gw.send(Generate("a", list(range(100, 400)), long, None, 1.0, None, None))
    gw.send(Generate("d", list(range(500, 600)), long, None, 1.0, time.time() + 0.5, None))
    gw.recv()
    gw.send(Abort(["a", "a"]))
    finished: dict[str, str] = {}
    end = time.monotonic() + 30
    while len(finished) < 2 and time.monotonic() < end:
        msg = gw.recv()
        if isinstance(msg, StepOutputs):
            finished.update({o.request_id: o.finish_reason for o in msg.outputs if o.finish_reason})
    assert finished == {"a": "abort", "d": "abort"}
    while True:  # the next heartbeat shows every block free again
        msg = gw.recv(skip_stats=False)
        if isinstance(msg, Stats):
            assert msg.kv_usage == 0.0 and msg.running == 0
            break


def test_a_gateways_own_worker_exits_when_its_gateway_goes_away(tiny_dir: Path) -> None:
    """A worker its gateway started (``--parent-pid``) exits once that gateway's connection has been gone 5 s,
    even while its parent process lives (a gateway wedged or cut off). One started by hand stays and rejoins the
    next gateway instead (issue 24 item 5, tests/test_external_worker.py)."""
    gw = FakeGateway()
    proc = subprocess.Popen([sys.executable, "-m", "workers.process.worker", "--connect", gw.addr,
                             "--model", str(tiny_dir), "--kv-cache-tokens", "1024", "--parent-pid", str(os.getpid())])
    try:
        assert isinstance(gw.recv(timeout_s=120), Hello)
        gw.close()  # like a SIGKILLed gateway: the TCP connection drops
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()


def test_shutdown_message(own_worker) -> None:  # type: ignore[no-untyped-def]
    gw, proc = own_worker
    gw.send(Shutdown())
    assert proc.wait(timeout=10) == 0
