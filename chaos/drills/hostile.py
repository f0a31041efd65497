"""The table of hostile inputs of the bad-input drill: bodies, numbers, encodings, headers and bytes that are not
HTTP at all. Each case is one raw request (``chaos.rawhttp``) and what it may be answered with.

``app`` cases are well-formed HTTP that reaches the application: any 4xx must be OpenAI's error shape. ``wire``
cases are broken HTTP that the server refuses before the application sees it: a 4xx of any body, or a close, is
fine. Neither may ever get a 5xx or no answer at all.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chaos.rawhttp import build

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_TYPE = (b"Content-Type", b"application/json")


@dataclass(frozen=True)
class Inputs:
    api_key: str
    model: str


@dataclass(frozen=True)
class Hostile:
    name: str
    request: Callable[[Inputs], bytes]
    app: bool = True  # reaches the app: refusals must be OpenAI-shaped


def _auth(i: Inputs) -> tuple[bytes, bytes]:
    return b"Authorization", f"Bearer {i.api_key}".encode()


def _post(path: str, body: bytes, *extra: tuple[bytes, bytes], auth: bool = True) -> Callable[[Inputs], bytes]:
    return lambda i: build("POST", path, body, ([_auth(i)] if auth else []) + [JSON_TYPE, *extra])


def _chat(**fields: Any) -> Callable[[Inputs], bytes]:
    """A chat body with ``fields`` over a valid base; a field given as bytes is spliced in as raw JSON text."""
    def make(i: Inputs) -> bytes:
        base: dict[str, Any] = {"model": i.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        raw = {k: v for k, v in fields.items() if isinstance(v, bytes)}
        text = json.dumps({**base, **{k: v for k, v in fields.items() if not isinstance(v, bytes)}})
        for k, v in raw.items():  # NaN, huge numbers, invalid escapes: things json.dumps would not write
            text = text[:-1] + f', "{k}": ' + v.decode("latin-1") + "}"
        return build("POST", CHAT, text.encode("latin-1"), [_auth(i), JSON_TYPE])
    return make


def _with_key(value: bytes, path: str = CHAT) -> Callable[[Inputs], bytes]:
    def make(i: Inputs) -> bytes:
        body = json.dumps({"model": i.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        return build("POST", path, body.encode(), [(b"Authorization", value.replace(b"KEY", i.api_key.encode())),
                                                  JSON_TYPE])
    return make


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _body_cases() -> list[Hostile]:
    ten_mb = json.dumps({"prompt": "x" * (10 * 1024 * 1024)}).encode()
    return [
        Hostile("deep JSON nesting (200k arrays)", _post(CHAT, _nested(200_000))),
        Hostile("deep nesting inside a message", _chat(messages=b'[{"role": "user", "content": '
                                                        + _nested(50_000) + b"}]")),
        Hostile("10 MB body", _post(COMPLETIONS, ten_mb)),
        Hostile("10 MB chunked body", lambda i: build("POST", COMPLETIONS, b"a00000\r\n" + b"x" * 0xA00000
                                                      + b"\r\n0\r\n\r\n", [_auth(i), JSON_TYPE,
                                                      (b"Transfer-Encoding", b"chunked")], content_length=False)),
        Hostile("invalid UTF-8 in the body", _chat(user=b'"\xff\xfe\xfd"')),
        Hostile("lone surrogate escape in content", _chat(messages=b'[{"role": "user", "content": "\\ud800"}]')),
        Hostile("empty body", _post(CHAT, b"")),
        Hostile("body is null", _post(CHAT, b"null")),
        Hostile("body is an array", _post(CHAT, b"[]")),
        Hostile("body is a number", _post(CHAT, b"1")),
        Hostile("unknown top-level field", _chat(frobnicate=1)),
        Hostile("unknown field in stream_options", _chat(stream=True, stream_options={"x": 1})),
        Hostile("10,000 messages", _chat(messages=[{"role": "user", "content": "word"}] * 10_000)),
        Hostile("100 stop strings", _chat(stop=["s"] * 100)),
        Hostile("unknown role", _chat(messages=[{"role": "tool", "content": "x"}])),
        Hostile("content part of unknown type", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    ]


def _number_cases() -> list[Hostile]:
    huge_int = b"1" + b"0" * 5000  # past Python's int-from-string digit limit
    return [
        Hostile("temperature NaN", _chat(temperature=b"NaN")),
        Hostile("temperature Infinity", _chat(temperature=b"Infinity")),
        Hostile("top_p -Infinity", _chat(top_p=b"-Infinity")),
        Hostile("temperature 1e400 (overflows to inf)", _chat(temperature=b"1e400")),
        Hostile("max_tokens 10^30", _chat(max_tokens=10**30)),
        Hostile("max_tokens with 5,000 digits", _chat(max_tokens=huge_int)),
        Hostile("max_tokens -1", _chat(max_tokens=-1)),
        Hostile("max_tokens 1.5", _chat(max_tokens=1.5)),
        Hostile("seed 2^64", _chat(seed=2**64)),
        Hostile("seed -2^63", _chat(seed=-(2**63))),
        Hostile("top_k -5", _chat(top_k=-5)),
        Hostile("top_logprobs 10^6", _chat(logprobs=True, top_logprobs=10**6)),
        Hostile("n 1000", _chat(n=1000)),
        Hostile("token id 10^20 in a prompt", lambda i: _post(COMPLETIONS, json.dumps(
            {"model": i.model, "prompt": [10**20], "max_tokens": 2}).encode())(i)),
        Hostile("negative token ids", lambda i: _post(COMPLETIONS, json.dumps(
            {"model": i.model, "prompt": [-1, -2], "max_tokens": 2}).encode())(i)),
        Hostile("stop_token_ids of strings", _chat(stop_token_ids=["a"])),
    ]


def _header_cases() -> list[Hostile]:
    return [
        Hostile("no Authorization", _post(CHAT, b"{}", auth=False)),
        Hostile("'Bearer' and nothing", _with_key(b"Bearer")),
        Hostile("two spaces after Bearer", _with_key(b"Bearer  KEY")),
        Hostile("lower-case scheme", _with_key(b"bearer KEY")),
        Hostile("Basic scheme", _with_key(b"Basic " + base64.b64encode(b"user:KEY"))),
        Hostile("key with a suffix", _with_key(b"Bearer KEYx")),
        Hostile("8 KB key", _with_key(b"Bearer kvg-" + b"A" * 8192)),
        Hostile("non-ASCII bytes in the key", _with_key(b"Bearer kvg-\xff\xfe\xe9")),
        Hostile("key then an injected header", _with_key(b"Bearer KEY\r\nX-Injected: 1")),
        Hostile("tenant key on /admin", _with_key(b"Bearer KEY", "/admin/tenants")),
        Hostile("two Authorization headers", lambda i: build("POST", CHAT, b"{}", [
            (b"Authorization", b"Bearer kvg-nope"), _auth(i), JSON_TYPE])),
        Hostile("Content-Type text/plain", _post(CHAT, b"{}", (b"Content-Type", b"text/plain"))),
        Hostile("Content-Type multipart without parts", _post(CHAT, b"--x--", (b"Content-Type",
                                                                             b"multipart/form-data; boundary=x"))),
        Hostile("Content-Type form-urlencoded", _post(CHAT, b"a=1&b=2", (b"Content-Type",
                                                                         b"application/x-www-form-urlencoded"))),
        Hostile("Content-Encoding gzip on a plain body", _post(CHAT, b"{}", (b"Content-Encoding", b"gzip"))),
        Hostile("path traversal to /etc/passwd", lambda i: build("GET", "/assets/../../../../etc/passwd")),
        Hostile("encoded NUL in the path", lambda i: build("GET", "/v1/models%00", headers=[_auth(i)])),
        Hostile("TRACE method", lambda i: build("TRACE", "/")),
        Hostile("DELETE on a generation route", lambda i: build("DELETE", CHAT, headers=[_auth(i)])),
    ]


def _wire_cases() -> list[Hostile]:
    return [
        Hostile("not HTTP at all", lambda i: b"GARBAGE\r\n\r\n", app=False),
        Hostile("NUL byte in a header", _with_key(b"Bearer kvg-\x00x"), app=False),
        Hostile("100 KB header", lambda i: build("GET", "/health", headers=[(b"X-Big", b"a" * 100_000)]), app=False),
        Hostile("64 KB path", lambda i: build("GET", "/" + "a" * 65_536), app=False),
        Hostile("chunk size not hex", lambda i: build("POST", CHAT, b"zz\r\nabc\r\n0\r\n\r\n", [
            _auth(i), JSON_TYPE, (b"Transfer-Encoding", b"chunked")], content_length=False), app=False),
        Hostile("two different Content-Lengths", lambda i: build("POST", CHAT, b"{}", [
            _auth(i), (b"Content-Length", b"2"), (b"Content-Length", b"5")], content_length=False), app=False),
        Hostile("negative Content-Length", lambda i: build("POST", CHAT, b"{}", [
            _auth(i), (b"Content-Length", b"-2")], content_length=False), app=False),
        Hostile("HTTP/1.0 without Host", lambda i: b"GET /health HTTP/1.0\r\n\r\n", app=False),
    ]


def cases() -> list[Hostile]:
    return [*_body_cases(), *_number_cases(), *_header_cases(), *_wire_cases()]
