"""Remote workers over ZeroMQ CURVE, on loopback (issue 14 item 3): only listed worker keys join; a refused peer
never gets a frame (not even one claiming a listed worker's id); the gateway's own local workers join with the key
it makes for them; a plain worker socket reachable from other hosts needs --insecure-workers."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from gateway.base.worker_security import WorkerSecurity
from gateway.config import GatewayConfig
from gateway.fleet.worker_auth import WorkerKeyring
from ipc.codec import decode, encode
from ipc.curve import ClientCurve, KeyPair, apply_client, is_local_endpoint, load_key_pair, load_public_key
from ipc.messages import PROTOCOL_VERSION, Hello, Refused
from ipc.sync_transport import worker_dealer
from workers.process.worker import default_worker_id
from chaos.procs import stop_process
from tests.curve_support import (WORKER_START_S, KeySet, complete, kvgate_keys, make_keys, start_worker, wait_for,
                                 worker_ids)
from tests.test_gateway_support import MODEL, REPO, Server, deployment_env, finish_start, free_port, start_server

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeySet:
    return make_keys(tmp_path_factory.mktemp("curve-keys"), listed=("good", "other"), unlisted=("intruder",))


# ---- keys and configuration (no server) ------------------------------------------------------------------


def test_kvgate_keys_writes_a_private_secret_and_never_overwrites(tmp_path: Path) -> None:
    out = kvgate_keys("create", "w1", "--dir", str(tmp_path / "k"))
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "k" / "w1.key", tmp_path / "k" / "w1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    pair = load_key_pair(secret)
    assert load_public_key(public) == pair.public and pair.public.decode() in out.stdout
    assert b"secret-key" not in public.read_bytes() and pair.secret.decode() not in out.stdout
    assert "secret=<hidden>" in repr(pair)
    shown = kvgate_keys("show", str(public))
    assert shown.returncode == 0 and shown.stdout.strip() == pair.public.decode()
    again = kvgate_keys("create", "w1", "--dir", str(tmp_path / "k"))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert load_key_pair(secret) == pair


def test_plain_worker_socket_beyond_loopback_needs_insecure_workers(keys: KeySet, tmp_path: Path) -> None:
    for local in ("tcp://127.0.0.1:0", "tcp://[::1]:5555", "tcp://localhost:5555", "ipc:///tmp/kvgate.sock"):
        assert is_local_endpoint(local), local
    for remote in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555", "tcp://gw:1"):
        assert not is_local_endpoint(remote), remote
        with pytest.raises(ValueError, match="--insecure-workers"):
            GatewayConfig(zmq_bind=remote)
        GatewayConfig(zmq_bind=remote, worker_security=WorkerSecurity(insecure_workers=True))
        GatewayConfig(zmq_bind=remote, worker_security=WorkerSecurity(str(keys.allowed), str(keys.secret("gateway"))))
    with pytest.raises(ValueError, match="go together"):
        GatewayConfig(worker_security=WorkerSecurity(worker_keys=str(keys.allowed)))
    # The command line refuses before loading anything, with the error and the way out.
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "gateway", "serve", "--workers", "0", "--port", str(port),
                          "--zmq-bind", f"tcp://0.0.0.0:{free_port()}", "--db", str(tmp_path / "kvgate.db")],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=deployment_env("0" * 64))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not authenticated" in out.stderr and "--insecure-workers" in out.stderr and "--worker-keys" in out.stderr


def test_keyring_reads_keys_added_later_and_logs_refusals_by_key(keys: KeySet, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    local, late = KeyPair.generate(), load_key_pair(keys.secret("intruder"))
    ring = WorkerKeyring(allowed, frozenset({local.public}))
    assert ring.callback("kvgate-workers", local.public)
    assert not ring.callback("kvgate-workers", late.public)
    assert not ring.callback("kvgate-workers", late.public)  # logged once a minute per key, not per retry
    refusals = [r for r in caplog.records if "refused a worker" in r.getMessage()]
    assert len(refusals) == 1 and late.public.decode() in refusals[0].getMessage()
    (allowed / "late.key").write_bytes(keys.public("intruder").read_bytes())
    assert ring.callback("kvgate-workers", late.public)  # listed now: no restart needed
    assert not ring.callback("another-domain", late.public)


# ---- real gateways and workers ----------------------------------------------------------------------------


def _raw_dealer(ctx: zmq.Context[Any], connect: str, identity: str, curve: ClientCurve | None) -> zmq.Socket[bytes]:
    """A peer that claims to be a worker (a listed worker's id, a valid Hello) and records what it is sent."""
    sock = worker_dealer(ctx, connect, identity, curve=curve)
    hello = Hello(PROTOCOL_VERSION, identity, os.getpid(), MODEL, 4096, 16, 1024, 49152, [2], 8, 512)
    try:
        sock.send(encode(hello), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # not even queued (no connection came up): it cannot reach the pool either way
    return sock


def _frames(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    got = []
    while sock.poll(0):
        got.append(sock.recv_multipart())
    return got


@pytest.fixture
def gateway_without_workers(tiny_model_dir: Path, tmp_path: Path, keys: KeySet) -> Iterator[tuple[Server, str]]:
    port = free_port()
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--zmq-bind", f"tcp://127.0.0.1:{port}",
                       *keys.gateway_args(), workers=0, wait=False)
    try:
        yield srv, f"tcp://127.0.0.1:{port}"
    finally:
        srv.stop()


def test_only_a_listed_worker_joins_and_a_refused_peer_gets_nothing(
        gateway_without_workers: tuple[Server, str], tiny_model_dir: Path, tmp_path: Path, keys: KeySet) -> None:
    srv, connect = gateway_without_workers
    env = deployment_env(srv.secret)
    intruder_pub = keys.public_z85("intruder")
    ctx: zmq.Context[Any] = zmq.Context()
    # A real worker process with an unlisted key, claiming the listed worker's id.
    intruder = start_worker(connect, "good", tiny_model_dir, tmp_path / "intruder.log", keys, "intruder", env)
    good: subprocess.Popen[bytes] | None = None
    spies: list[zmq.Socket[bytes]] = []
    try:
        wait_for("the intruder worker to exit", lambda: intruder.poll() is not None, WORKER_START_S)
        intruder_log = (tmp_path / "intruder.log").read_text(errors="replace")
        assert intruder.returncode == 1, intruder_log[-3000:]
        assert "the gateway refused this worker's CURVE key" in intruder_log and intruder_pub in intruder_log
        assert f"refused a worker: public key {intruder_pub}" in srv.log()
        # Peers that keep trying: CURVE with the unlisted key, and plain ZeroMQ. Each sends a valid Hello.
        spies.append(_raw_dealer(ctx, connect, "good", ClientCurve(load_key_pair(keys.secret("intruder")),
                                                                    load_public_key(keys.public("gateway")))))
        spies.append(_raw_dealer(ctx, connect, "plain", None))
        # Nobody joined: not ready, and a request is refused by the gateway (503), served by no one.
        wait_for("the gateway's HTTP port", lambda: _responds(srv), 240)
        assert httpx.get(f"{srv.url}/ready", timeout=10).status_code == 503
        srv.api_key = finish_key(srv)
        r = complete(srv)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
        # The listed worker joins and serves.
        good = start_worker(connect, "good", tiny_model_dir, tmp_path / "good.log", keys, "good", env)
        finish_start(srv)
        r = complete(srv, max_tokens=6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert worker_ids(srv) == ["good"]
        assert f"worker key {keys.public_z85('good')} accepted" in srv.log()
        time.sleep(1.0)  # the spies' reconnects keep being refused meanwhile
        assert [_frames(s) for s in spies] == [[], []]  # never a frame: no Generate, no prompt, not even a ping
        assert worker_ids(srv) == ["good"]  # neither spy's Hello ever reached the pool
        assert good.poll() is None
    finally:
        for s in spies:
            s.close(linger=0)
        ctx.destroy(linger=0)  # every socket of it: a failure above must fail the test, not hang it in term()
        stop_process(intruder)
        if good is not None:
            stop_process(good)


def _responds(srv: Server) -> bool:
    try:
        httpx.get(f"{srv.url}/health", timeout=2)
        return True
    except httpx.TransportError:
        return False


def finish_key(srv: Server) -> str:
    """The demo key the gateway printed at start (finish_start reads it too, but only once ready)."""
    wait_for("the demo key", lambda: "export KVGATE_API_KEY=" in srv.log(), 60)
    return srv.log().split("export KVGATE_API_KEY=", 1)[1].split()[0]


def test_local_workers_join_a_curve_gateway_with_its_own_key(tiny_model_dir: Path, tmp_path: Path,
                                                             keys: KeySet) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "gateway.log", "--zmq-bind", "tcp://0.0.0.0:0",
                       *keys.gateway_args(), workers=1)  # all interfaces: allowed because CURVE is on
    try:
        r = complete(srv, max_tokens=4)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert "(local worker)" in srv.log()
        [pid] = srv.worker_pids()
        # The local worker's secret travels in its environment (owner-only), never on its command line.
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        [secret] = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"KVGATE_CURVE_SECRET_KEY=")]
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        srv.stop()


def test_a_listed_key_cannot_take_over_another_workers_id(
        gateway_without_workers: tuple[Server, str], tiny_model_dir: Path, tmp_path: Path, keys: KeySet) -> None:
    """Issue 24 item 1: worker ids are bound to keys. A peer holding another listed key ("other") connects with
    the serving worker's id ("good") as its ZeroMQ routing id and says Hello as "good": it must neither displace
    the worker nor receive a frame meant for it (a prompt least of all), and its Hello is refused with a reason."""
    srv, connect = gateway_without_workers
    env = deployment_env(srv.secret)
    ctx: zmq.Context[Any] = zmq.Context()
    good = start_worker(connect, "good", tiny_model_dir, tmp_path / "good.log", keys, "good", env)
    thief: zmq.Socket[bytes] | None = None
    try:
        finish_start(srv)
        assert complete(srv, max_tokens=2).status_code == 200
        other = ClientCurve(load_key_pair(keys.secret("other")), load_public_key(keys.public("gateway")))
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.ROUTING_ID, b"good")  # the old routing id of worker "good": a takeover attempt
        thief.setsockopt(zmq.LINGER, 0)
        apply_client(thief, other)
        thief.connect(connect)
        hello = Hello(PROTOCOL_VERSION, "good", os.getpid(), MODEL, 4096, 16, 1024, 49152, [2], 8, 512)
        thief.send(encode(hello))
        wait_for("the gateway to refuse the thief's Hello", lambda: "may not serve as worker good" in srv.log(), 60)
        for _ in range(4):  # prompts keep going to the real worker
            r = complete(srv, max_tokens=3)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert worker_ids(srv) == ["good"]
        got = [decode(f[-1]) for f in _frames(thief)]
        assert got and all(isinstance(m, Refused) for m in got), got  # told why, and nothing else
        assert "key other may serve worker ids other and other/*" in got[0].reason
        assert good.poll() is None
        # A real worker whose key may not serve the id it was given learns why and exits 1 (a supervisor sees it).
        stray = start_worker(connect, "other", tiny_model_dir, tmp_path / "stray.log", keys, "good", env)
        wait_for("the stray worker to exit", lambda: stray.poll() is not None, WORKER_START_S)
        stray_log = (tmp_path / "stray.log").read_text(errors="replace")
        assert stray.returncode == 1, stray_log[-3000:]
        assert "the gateway refused this worker: worker id 'other' refused: key good may serve" in stray_log
        assert worker_ids(srv) == ["good"] and complete(srv, max_tokens=2).status_code == 200
    finally:
        if thief is not None:
            thief.close(linger=0)
        ctx.term()
        stop_process(good)


def test_worker_id_binding_rules(keys: KeySet) -> None:
    """Which ids a key may serve: a listed key NAME serves NAME and NAME/anything; the gateway's own key serves
    the ids of the workers it starts; without CURVE there is no key and no binding."""
    local = KeyPair.generate()
    ring = WorkerKeyring(keys.allowed, frozenset({local.public}))
    good, other = keys.public_z85("good"), keys.public_z85("other")
    assert ring.refusal(good, "good") is None and ring.refusal(good, "good/host-1") is None
    assert ring.refusal(other, "good") is not None and ring.refusal(other, "good/host-1") is not None
    assert ring.refusal(good, "goodness") is not None and ring.refusal(good, "w0") is not None
    ring.local_ids = frozenset({"w0", "w1"})
    assert ring.refusal(local.public.decode(), "w1") is None and ring.refusal(local.public.decode(), "good") is not None
    assert ring.refusal(None, "good") is not None  # CURVE on, yet no key on the frame: refused, never guessed
    assert ring.refusal(keys.public_z85("intruder"), "intruder") is not None
    # kvgate worker's default id is one its key may serve.
    assert default_worker_id(str(keys.secret("good"))) == f"good/{os.getpid()}"
    assert default_worker_id(None) == f"worker-{os.getpid()}"
