"""A remote worker over real TCP between two "hosts" (issue 14 item 3): two network namespaces joined by a veth
pair, the gateway in one (its worker socket bound to its veth address, CURVE on), a ``kvgate worker`` in the other
with a listed key; a request is served end to end, and a worker with an unlisted key is refused.

Needs root and iproute2; never runs in CI (the issue asks for it on a developer's machine: it changes the host's
network configuration, however briefly). The namespaces and the veth pair are removed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.procs import stop_process
from tests.curve_support import WORKER_START_S, KeySet, make_keys, start_worker, wait_for
from tests.test_gateway_support import ADMIN_TOKEN, MAX_MODEL_LEN, MODEL, REPO, deployment_env

pytestmark = pytest.mark.timeout(600)

GATEWAY_PORT = 8000  # inside the gateway's namespace, where nothing else listens
ZMQ_PORT = 5555


def _skip_reason() -> str | None:
    # .ci/run marks CI by exporting KVGATE_REQUIRE_* (and CI services set CI): never run there.
    if os.environ.get("CI") or any(os.environ.get(v) for v in ("KVGATE_REQUIRE_REDIS", "KVGATE_REQUIRE_POSTGRES",
                                                                "KVGATE_REQUIRE_BROWSER")):
        return "network-namespace test: developer machines only, never CI (issue 14)"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    return None


@dataclass(frozen=True)
class Hosts:
    gateway_ns: str
    worker_ns: str
    gateway_ip: str
    worker_ip: str

    def exec(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    gw_ns, wk_ns = f"kvg-gw-{tag}", f"kvg-wk-{tag}"
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    made: list[str] = []
    try:
        try:
            for ns in (gw_ns, wk_ns):
                _ip("netns", "add", ns)
                made.append(ns)
        except RuntimeError as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        # The veth pair is created in the gateway's namespace, so deleting the namespaces deletes it too.
        _ip("-n", gw_ns, "link", "add", "veth-gw", "type", "veth", "peer", "name", "veth-wk", "netns", wk_ns)
        for ns, dev, addr in ((gw_ns, "veth-gw", f"{subnet}.1"), (wk_ns, "veth-wk", f"{subnet}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(gw_ns, wk_ns, f"{subnet}.1", f"{subnet}.2")
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _http(hosts: Hosts, method: str, path: str, token: str, body: dict[str, object] | None = None) -> tuple[int, str]:
    """An HTTP call from inside the gateway's namespace (its port is not reachable from the test's)."""
    code = ("import httpx, json, sys; a = json.loads(sys.argv[1]); "
            "h = {'Authorization': 'Bearer ' + a['t']} if a['t'] else {}; "
            "r = httpx.request(a['m'], a['u'], json=a['b'], headers=h, timeout=120); print(r.status_code); print(r.text)")
    arg = json.dumps({"m": method, "u": f"http://127.0.0.1:{GATEWAY_PORT}{path}", "b": body, "t": token})
    out = subprocess.run([*hosts.exec(hosts.gateway_ns), sys.executable, "-c", code, arg], capture_output=True,
                         text=True, timeout=150, cwd=REPO)
    if out.returncode != 0:  # not listening yet, or a bug here: shown if the test times out waiting
        return 0, out.stderr[-2000:]
    status, _, text = out.stdout.partition("\n")
    return int(status), text


def test_remote_worker_across_namespaces_serves_over_curve(hosts: Hosts, tiny_model_dir: Path, tmp_path: Path) -> None:
    keys: KeySet = make_keys(tmp_path / "keys", listed=("remote",), unlisted=("stranger",))
    env = deployment_env(secrets.token_hex(32))
    gw_log = tmp_path / "gateway.log"
    zmq_addr = f"tcp://{hosts.gateway_ip}:{ZMQ_PORT}"
    cmd = [*hosts.exec(hosts.gateway_ns), sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1",
           "--port", str(GATEWAY_PORT), "--model", str(tiny_model_dir), "--served-model-name", MODEL,
           "--workers", "0", "--zmq-bind", zmq_addr, *keys.gateway_args(), "--db", str(tmp_path / "kvgate.db"),
           "--admin-token", ADMIN_TOKEN, "--max-model-len", str(MAX_MODEL_LEN), "--log-format", "text"]
    with gw_log.open("wb") as log:
        gateway = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    worker_exec = hosts.exec(hosts.worker_ns)
    remote = stranger = None
    try:
        remote = start_worker(zmq_addr, "remote", tiny_model_dir, tmp_path / "remote.log", keys, "remote", env,
                              prefix=worker_exec)
        stranger = start_worker(zmq_addr, "stranger", tiny_model_dir, tmp_path / "stranger.log", keys, "stranger",
                                env, prefix=worker_exec)
        wait_for("the gateway ready with the remote worker",
                 lambda: _gateway_alive(gateway, gw_log) and _http(hosts, "GET", "/ready", "")[0] == 200,
                 2 * WORKER_START_S)  # two workers load at once on a shared 2-core box
        api_key = gw_log.read_text().split("export KVGATE_API_KEY=", 1)[1].split()[0]
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        status, text = _http(hosts, "POST", "/v1/completions", api_key, body)
        assert status == 200, text
        completion = json.loads(text)
        assert completion["usage"]["completion_tokens"] == 8
        status, text = _http(hosts, "GET", "/admin/workers", ADMIN_TOKEN)
        assert [w["hello"]["worker_id"] for w in json.loads(text)["data"]] == ["remote"]
        # Real TCP between the namespaces: the gateway's end sees the worker's veth address.
        ss = subprocess.run([*hosts.exec(hosts.gateway_ns), "ss", "-tnH", "state", "established"],
                            capture_output=True, text=True, timeout=30).stdout
        assert f"{hosts.gateway_ip}:{ZMQ_PORT}" in ss and f"{hosts.worker_ip}:" in ss, ss
        wait_for("the stranger refused", lambda: stranger.poll() is not None, WORKER_START_S)
        assert stranger.returncode == 1
        assert "the gateway refused this worker's CURVE key" in (tmp_path / "stranger.log").read_text()
        assert f"refused a worker: public key {keys.public_z85('stranger')}" in gw_log.read_text()
        print(f"\nnamespaces {hosts.gateway_ns} ({hosts.gateway_ip}) <-veth-> {hosts.worker_ns} ({hosts.worker_ip})"
              f"\nestablished TCP in the gateway's namespace:\n{ss.strip()}\ncompletion served by worker 'remote': "
              f"{json.dumps(completion['usage'])}\nstranger ({keys.public_z85('stranger')}) refused, exit status "
              f"{stranger.returncode}")
    finally:
        for proc in (remote, stranger):
            if proc is not None:
                stop_process(proc)
        stop_process(gateway)


def _gateway_alive(gateway: subprocess.Popen[bytes], log: Path) -> bool:
    if gateway.poll() is not None:
        raise RuntimeError(f"gateway exited with {gateway.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
    return True
