"""Fixtures for the browser tests: Debian's Chromium driven by Playwright for Python, and a gateway that allows
one cross-origin page (``--cors-origin``) so CORS can be checked from a real browser.

Playwright's own browser builds are never downloaded: ``executable_path`` points at /usr/bin/chromium (the
Makefile installs Debian's ``chromium`` for ``make test``). Without Chromium or Playwright the tests skip, except
where the environment sets KVGATE_REQUIRE_BROWSER=1 (CI does, in .ci/run): there they fail.

The fixtures (``browser``, ``origins``, ``page``, ``shots``, ``web_server``, ``open_page``) are registered for every
test module by tests/conftest.py.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_gateway_support import Server, metric_sum, start_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
UI_TIMEOUT_MS = 30_000  # a loaded 2-core machine can be slow to paint; the waits poll a condition, never sleep


def require_browser() -> str:
    """Path of Chromium, or skip (fail with KVGATE_REQUIRE_BROWSER=1) when it or Playwright is missing."""
    missing = []
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append(f"{CHROMIUM} (apt-get install chromium, or make test as root)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install -e '.[test]')")
    if missing:
        message = "browser tests need " + " and ".join(missing)
        if os.environ.get("KVGATE_REQUIRE_BROWSER") == "1":
            pytest.fail(message + "; KVGATE_REQUIRE_BROWSER=1", pytrace=False)
        pytest.skip(message)
    return CHROMIUM if os.path.exists(CHROMIUM) else str(shutil.which("chromium"))


@dataclass(frozen=True)
class Origins:
    allowed: str  # the browser-test gateway names it with --cors-origin
    other: str  # it does not


class _BlankPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>another web app</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


# pytest makes one instance of a session fixture per test module that imports it, so the fixtures below
# build each thing once (the first module to ask owns it and tears it down at the session's end) and every
# other module reuses it: one gateway, one browser, one pair of origins for all the browser tests.
_SHARED: dict[str, Any] = {}


def _once(name: str, make: Callable[[], AbstractContextManager[Any]]) -> Iterator[Any]:
    if name in _SHARED:
        yield _SHARED[name]
        return
    with make() as value:
        _SHARED[name] = value
        try:
            yield value
        finally:
            del _SHARED[name]


@contextmanager
def _blank_origins() -> Iterator[Origins]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _BlankPage) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        allowed, other = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        yield Origins(allowed, other)
    finally:
        for s, t in zip(servers, threads):
            s.shutdown()
            s.server_close()
            t.join(5)


@pytest.fixture(scope="session")
def origins() -> Iterator[Origins]:
    """Two other web apps on loopback (real servers: Chromium refuses a page it cannot place in an address
    space, such as one served by Playwright's routing, any call to 127.0.0.1)."""
    yield from _once("origins", _blank_origins)


@contextmanager
def _gateway(model_dir: Path, log_dir: Path, allowed: str) -> Iterator[Server]:
    # Steps held 2 ms each (the worker's KVGATE_DEBUG_STEP_DELAY drill hook): a page that watches a running
    # answer (the operator page, Stop) needs a 3,000-token answer to last seconds on any machine; the tiny
    # model alone streams it in about two once decode steps run in C++.
    srv = start_server(model_dir, log_dir / "gateway.log", "--cors-origin", allowed,
                       env={"KVGATE_DEBUG_STEP_DELAY": "0.002"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def web_server(tiny_model_dir: Path, origins: Origins, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _once("web_server", lambda: _gateway(tiny_model_dir, tmp_path_factory.mktemp("web-gateway"),
                                                    origins.allowed))


@contextmanager
def _chromium() -> Iterator[Any]:
    executable = require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    yield from _once("browser", _chromium)  # without Chromium, skips (or fails) in every module that asks


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go (the session's temp dir, or $KVGATE_SCREENSHOTS to keep them)."""
    keep = os.environ.get("KVGATE_SCREENSHOTS")
    path = Path(keep) if keep else _SHARED.setdefault("shots", tmp_path_factory.mktemp("screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class BrowserPage:
    """A page in a fresh context (its own sessionStorage), recording console errors and uncaught exceptions."""

    page: Any
    server: Server
    errors: list[str] = field(default_factory=list)

    def open(self, path: str, key: str | None = None) -> None:
        self.page.goto(self.server.url + path, wait_until="load")
        if key is not None:  # as a person would: paste, then "Use key"
            self.page.fill("#key", key)
            self.page.click("#use-key")

    def wait_for(self, js: str, arg: Any = None, timeout_ms: int = UI_TIMEOUT_MS) -> Any:
        """Polls ``js`` (an expression, or a function of ``arg``) every frame until it is truthy. An expression
        is wrapped in a function: Playwright would eval() it in the page, which the page's CSP forbids."""
        fn = js if js.lstrip().startswith(("(", "function", "async")) else f"() => ({js})"
        return self.page.wait_for_function(fn, arg=arg, timeout=timeout_ms, polling="raf").json_value()

    def text(self, selector: str) -> str:
        return str(self.page.inner_text(selector))


def _page(browser: Any, server: Server, **context_args: Any) -> Generator[BrowserPage, None, None]:
    context = browser.new_context(viewport={"width": 1280, "height": 860}, accept_downloads=True, **context_args)
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    bp = BrowserPage(page, server)
    page.on("console", lambda m: bp.errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: bp.errors.append(f"pageerror: {e}"))
    try:
        yield bp
    finally:
        context.close()


@pytest.fixture
def page(browser: Any, web_server: Server) -> Iterator[BrowserPage]:
    yield from _page(browser, web_server)


@pytest.fixture
def open_page(browser: Any, web_server: Server) -> Iterator[Callable[..., BrowserPage]]:
    """For tests that need several pages or context options (bypass_csp): open_page(**context_args)."""
    made: list[Generator[BrowserPage, None, None]] = []

    def make(**context_args: Any) -> BrowserPage:
        gen = _page(browser, web_server, **context_args)
        made.append(gen)
        return next(gen)

    yield make
    for gen in made:
        gen.close()


def worker_busy(server: Server) -> tuple[float, float]:
    """(running, KV usage) summed over the workers, from /metrics as a dashboard reads them."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return metric_sum(text, "vllm:num_requests_running"), metric_sum(text, "vllm:kv_cache_usage_perc")


def seconds_until_idle(server: Server, since: float, within: float) -> float:
    """Seconds from ``since`` (time.monotonic) until the worker holds no request and no KV block."""
    while True:
        running, kv = worker_busy(server)
        elapsed = time.monotonic() - since
        if running == 0 and kv == 0:
            return elapsed
        if elapsed > within:
            raise AssertionError(f"worker still busy {elapsed:.2f}s after Stop: running={running} kv={kv}")
        time.sleep(0.02)
