"""A request whose body arrives after the headers must not wedge its keep-alive connection.

Found by the bad-input chaos drill (schemathesis timed out on the request after an OPTIONS or a 405): with hypercorn
0.18's trio worker, when the gateway answered before the request body had arrived (a 401, 404 or 405 decided from
the headers alone; http.client sends headers and body in two writes) the client's next request on that connection
was never answered. The gateway now takes in the whole body before answering (``read_body_first``); a body it could
not take (413) is answered with ``Connection: close``.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.test_gateway_support import MODEL, Server

BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()


def _response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) read off a raw socket; b"" when it closed instead."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head


@pytest.mark.parametrize("request_line", [b"PUT /health", b"POST /no-such-route", b"POST /v1/completions"])
def test_late_body_does_not_wedge_the_connection(server: Server, request_line: bytes) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        for _ in range(3):  # before the fix the first follow-up already timed out
            sock.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer kvg-no\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n")
            time.sleep(0.05)  # the body comes in a later segment, as from http.client
            sock.sendall(BODY)
            assert _response(sock).startswith(b"HTTP/1.1 4")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                assert _response(sock).startswith(b"HTTP/1.1 200")
            except TimeoutError:
                pytest.fail("the connection wedged: the next request on it was never answered")


def test_body_too_large_closes_the_connection(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30.0, headers=server.headers) as client:
        r = client.post("/v1/completions", content=b"x" * (5 * 1024 * 1024),
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.headers.get("connection") == "close"
        assert r.json()["error"]["code"] == "request_too_large"
        ok = client.post("/v1/completions", content=BODY, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200 and ok.headers.get("connection") != "close"
