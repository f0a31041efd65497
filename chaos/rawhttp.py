"""HTTP/1.1 over a bare Trio TCP stream, for requests no well-behaved client library will send: bytes that are not
UTF-8 in a header, a header of 100 KB, a chunk size that is not a number, a body larger than allowed.

One request per connection; an answer ends by its own framing (or when the server closes). ``exchange`` returns
what came back: a status and the body, or that the server closed without a word (acceptable for bytes that are not
HTTP), or that nothing came back in time (a hang: never acceptable).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

MAX_ANSWER = 1 << 20  # read no more than this of any answer


@dataclass(frozen=True)
class RawAnswer:
    status: int | None  # None: closed without a status line
    headers: dict[str, str]
    body: bytes
    hung: bool = False  # nothing conclusive within the deadline


def build(method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None,
          *, content_length: bool = True) -> bytes:
    """A request with ``Host`` and ``Connection: close``; ``headers`` are sent as given, byte for byte."""
    lines = [f"{method} {path} HTTP/1.1".encode("latin-1"), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers or []]
    if content_length and body:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def parse(raw: bytes) -> RawAnswer:
    head, sep, body = raw.partition(b"\r\n\r\n")
    first, *header_lines = head.split(b"\r\n")
    parts = first.split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return RawAnswer(None, {}, raw)
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _unchunk(body)
    return RawAnswer(int(parts[1]), headers, body)


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return bytes(out)


def complete(raw: bytes) -> bool:
    """Whether ``raw`` holds one whole response by its own framing (Content-Length or chunked). The server cannot
    be trusted to close after ``Connection: close``: hypercorn 0.18 keeps the socket open (pgjones/hypercorn#330)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    fields = {ln.partition(b":")[0].strip().lower(): ln.partition(b":")[2].strip() for ln in head.split(b"\r\n")[1:]}
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        return body.endswith(b"0\r\n\r\n")
    length = fields.get(b"content-length")
    return length is not None and length.isdigit() and len(body) >= int(length)


async def exchange(host: str, port: int, request: bytes, timeout: float) -> RawAnswer:
    """Send ``request`` and read one response (by its framing, or until the server closes, or MAX_ANSWER); nothing
    conclusive within ``timeout`` is a hang."""
    received = bytearray()
    with trio.move_on_after(timeout) as scope:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as e:  # nobody listening any more: the caller's process checks say why
            return RawAnswer(None, {}, f"connect failed: {e}".encode())
        async with stream:
            try:
                await stream.send_all(request)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # it answered (say 413) and closed before taking all of a large body: read that answer
            try:
                while len(received) < MAX_ANSWER and not complete(bytes(received)):
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    received += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # reset after its answer
    if scope.cancelled_caught:
        return RawAnswer(None, {}, bytes(received), hung=True)
    return parse(bytes(received))
