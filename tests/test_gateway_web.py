"""The gateway's browser edge over plain HTTP (no browser): pages and assets with their security headers, no
inline script anywhere, CORS off by default, and /admin/workers agreeing with /metrics (what kvgatectl top reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from gateway.cli import add_serve_parser, config_from_args
from gateway.config import GatewayConfig
from gateway.api.web import CSP, PAGES, STATIC_DIR, _split_fields
from console.top import compute_view, parse_exposition
from tests.test_gateway_support import Server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


class _Markup(HTMLParser):
    """Collects what a CSP without 'unsafe-inline' would refuse, and the assets a page loads."""

    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []
        self.assets: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.inline += [f"{tag} {name}=" for name in a if name.startswith("on") or name == "style"]
        if tag == "style":
            self.inline.append("<style>")
        if tag == "script":
            self._in_script = True
            if not a.get("src"):
                self.inline.append("<script> without src")
        for name in ("src", "href"):
            value = a.get(name)
            if value and value.startswith("/assets/"):
                self.assets.append(value)

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append("script body")


def _assert_security_headers(r: httpx.Response) -> None:
    assert r.headers["content-security-policy"] == CSP
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_pages_have_security_headers_and_no_inline_script(server: Server) -> None:
    assert "'unsafe-inline'" not in CSP and "'unsafe-eval'" not in CSP and "script-src 'self'" in CSP
    for path in PAGES:
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        _assert_security_headers(r)
        markup = _Markup()
        markup.feed(r.text)
        assert markup.inline == [], (path, markup.inline)
        assert markup.assets, path
        for asset in markup.assets:
            a = httpx.get(server.url + asset, timeout=10)
            assert a.status_code == 200, asset
            _assert_security_headers(a)
    assert httpx.get(f"{server.url}/health", timeout=10).headers["x-content-type-options"] == "nosniff"


def test_assets_are_served_with_their_types(server: Server) -> None:
    types = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
    shipped = sorted(STATIC_DIR.iterdir())
    assert {p.suffix for p in shipped} <= set(types)
    for path in shipped:
        r = httpx.get(f"{server.url}/assets/{path.name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(types[path.suffix]), path.name
        assert r.content == path.read_bytes()
    missing = httpx.get(f"{server.url}/assets/nothing.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_scripts_never_turn_text_into_markup() -> None:
    # The pages put model output and server messages in the DOM with textContent / Text nodes only.
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
                       r"setAttribute\(\s*['\"]on|localStorage\.|location\.(search|hash)")
    for path in STATIC_DIR.glob("*.js"):
        found = [m.group(0) for m in sinks.finditer(path.read_text())]
        assert found == [], (path.name, found)


def test_cors_is_off_by_default(server: Server) -> None:
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(f"{server.url}/v1/chat/completions", timeout=10, headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 403 and preflight.json()["error"]["code"] == "cors_origin_not_allowed"
    assert not [h for h in preflight.headers if h.startswith("access-control-")]
    plain = httpx.get(f"{server.url}/v1/models", headers={**origin, **server.headers}, timeout=10)
    assert plain.status_code == 200 and not [h for h in plain.headers if h.startswith("access-control-")]


def test_admin_workers_needs_the_admin_token(server: Server) -> None:
    url = f"{server.url}/admin/workers"
    assert httpx.get(url, timeout=10).json()["error"]["code"] == "invalid_admin_token"
    wrong = httpx.get(url, headers=server.headers, timeout=10)  # a tenant key is not the admin token
    assert wrong.status_code == 401


def test_admin_workers_agrees_with_metrics(server: Server) -> None:
    before = _generated(server)
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                   json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200
    # Stats are heartbeats: wait for the one that counts this request, then compare both views of it.
    wait_until(lambda: _generated(server), lambda n: n >= before + 6, within=10.0,
               what="a heartbeat counting the request")
    snap = parse_exposition(httpx.get(f"{server.url}/metrics", timeout=10).text, 0.0)
    body = httpx.get(f"{server.url}/admin/workers", headers=server.admin_headers, timeout=10).json()
    assert body["workers_ready"] == len(body["data"]) == 1 and body["model"] == "tiny"
    (worker,) = body["data"]
    (row,) = compute_view(server.url, None, snap).workers  # the figures kvgatectl top shows
    stats = worker["stats"]
    assert (worker["worker"], stats["running"], stats["waiting"], stats["kv_usage"], stats["num_preemptions"]) == (
        row.worker, row.running, row.waiting, row.kv_cache_usage, row.preemptions)
    for field, family in [("generation_tokens_total", "vllm:generation_tokens_total"),
                          ("prompt_tokens_total", "vllm:prompt_tokens_total"),
                          ("prefix_hits", "vllm:prefix_cache_hits_total")]:
        assert stats[field] == sum(snap.series[family].values()), field
    assert stats["generation_tokens_total"] > 0 and stats["prompt_tokens_total"] > 0
    assert worker["hello"]["pid"] in server.worker_pids() and worker["hello"]["model"]
    assert worker["seconds_since_heartbeat"] >= 0 and isinstance(body["sampled_at"], float)


def _generated(server: Server) -> int:
    body = httpx.get(f"{server.url}/admin/workers", headers=server.admin_headers, timeout=10).json()
    return sum(w["stats"].get("generation_tokens_total", 0) for w in body["data"])


# ---- units ------------------------------------------------------------------------------------------------

def test_cors_origin_setting() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--cors-origin", "https://a.example", "--cors-origin", "http://[::1]:3000"])
    assert config_from_args(args).cors_origins == ("https://a.example", "http://[::1]:3000")
    assert config_from_args(parser.parse_args(["serve"])).cors_origins == ()
    assert GatewayConfig(cors_origins=("*",)).cors_origins == ("*",)
    for bad in ("https://a.example/", "a.example", "https://a.example/path", "ftp://a.example", ""):
        with pytest.raises(ValueError, match="--cors-origin"):
            GatewayConfig(cors_origins=(bad,))


class _Health(enum.Enum):
    SLOW = "slow"


@dataclasses.dataclass(frozen=True)
class _FutureStats:
    running: int
    step_elapsed: float | None
    status: _Health
    idle_for: float
    request_ids: list[str]


def test_worker_fields_are_read_generically() -> None:
    scalars, counts = _split_fields(_FutureStats(2, None, _Health.SLOW, math.nan, ["a", "b", "c"]))
    assert scalars == {"running": 2, "step_elapsed": None, "status": "slow", "idle_for": None}
    assert counts == {"request_ids": 3}


def test_static_files_ship_with_the_package() -> None:
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^"gateway.api" = \[[^\]]*"static/\*"', pyproject, re.M), "api/static: package data"
