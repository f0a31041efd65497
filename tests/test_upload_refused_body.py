"""An upload without a valid key is refused before its body is read, and the body is not taken into memory.
Before, every body was read whole before its handler ran (http_json.read_body_first), and an upload's limit is
--max-file-bytes (100 MB by default): each caller without a key could make the gateway hold that much, and got
its 401 only after sending it all."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.test_gateway_support import Server, start_server

pytestmark = pytest.mark.timeout(300)
MB = 1024 * 1024
DECLARED = 400 * MB  # the Content-Length the caller announces (under the limit below)
AFTER = 96 * MB  # what it tries to send after the refusal


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("upload-refused") / "gateway.log",
                     "--max-file-bytes", str(512 * MB))
    yield s
    s.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _refused_upload(srv: Server, auth: bytes) -> tuple[bytes, int, int]:
    """(status line, bytes sent after the answer, the gateway's RSS growth meanwhile), the socket still open."""
    u = urlsplit(srv.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\n" + auth +
                     b"Content-Type: multipart/form-data; boundary=b\r\n"
                     b"Content-Length: %d\r\n\r\n" % DECLARED + b"--b\r\n" + b"x" * (64 * 1024))
        head = b""
        while b"\r\n\r\n" not in head:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                raise AssertionError("no answer before the body: the gateway waits to read it all") from None
            assert chunk, "the gateway closed the connection without an answer"
            head += chunk
        base = _rss(srv.proc.pid)
        sock.settimeout(3)  # the server may drain the rest (discarding it) or stop reading: either is fine
        sent, block = 0, b"y" * MB
        try:
            while sent < AFTER:
                sock.sendall(block)
                sent += len(block)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        time.sleep(0.5)  # whatever it did take has reached the request body by now
        return head.split(b"\r\n", 1)[0], sent, _rss(srv.proc.pid) - base


@pytest.mark.parametrize("auth", [b"", b"Authorization: Bearer sk-not-a-key\r\n"], ids=["no-key", "bad-key"])
def test_a_refused_upload_is_not_received_into_memory(srv: Server, auth: bytes) -> None:
    status, sent, grew = _refused_upload(srv, auth)
    assert status.startswith(b"HTTP/1.1 401"), status
    # What the gateway holds, not what it drains: 96 MB sent after the answer (when it keeps reading) grow it little.
    assert grew < 32 * MB, (sent // MB, grew // MB)
    assert "Traceback" not in srv.log()


def test_a_client_gets_the_refusal_whole_and_its_next_request_goes_through(srv: Server) -> None:
    # httpx sends the whole file, then reads the 401 (Connection: close) and opens a new connection for the next
    # request on the same client: nothing wedges.
    files = {"file": ("in.jsonl", b"x" * (4 * MB)), "purpose": (None, b"batch")}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        refused = client.post("/v1/files", files=files, headers={"Authorization": "Bearer sk-not-a-key"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
        assert refused.headers.get("connection") == "close"
        listed = client.get("/v1/files", headers=srv.headers)
        assert listed.status_code == 200 and listed.json()["object"] == "list", listed.text
