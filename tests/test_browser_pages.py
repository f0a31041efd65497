"""The usage and operator pages and CORS, in real Chromium against a real gateway (tiny random-weight worker).

Every page loads with no console error and no uncaught exception; the usage page draws what /v1/usage says;
the operator page shows a running request live and the same figures /metrics has; a page on an origin the
gateway allows (--cors-origin) can call the API, a page on another origin cannot (the preflight is refused).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_browser_support import BrowserPage, Origins, worker_busy
from tests.test_gateway_support import ADMIN_TOKEN, Server

pytestmark = pytest.mark.timeout(180)


def _one_request(server: Server, max_tokens: int = 8) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text


def test_every_page_loads_without_console_errors(page: BrowserPage, web_server: Server) -> None:
    _one_request(web_server)  # so the usage page has rows to draw
    for path, secret, ready in [("/", web_server.api_key, "document.querySelectorAll('#model option').length > 0"),
                                ("/playground", None, "document.querySelectorAll('#model option').length > 0"),
                                ("/usage", None, "document.querySelectorAll('#day-table tbody tr').length > 0"),
                                ("/operator", ADMIN_TOKEN, "document.querySelectorAll('#workers tbody tr').length")]:
        response = page.page.goto(web_server.url + path, wait_until="load")
        assert response is not None and response.status == 200
        assert "script-src 'self'" in response.headers["content-security-policy"]
        if secret is not None:  # the API key then stays in this tab's sessionStorage for the next pages
            page.page.fill("#key", secret)
            page.page.click("#use-key")
        page.wait_for(ready)
        page.page.wait_for_load_state("networkidle")
        assert page.errors == [], (path, page.errors)


def test_usage_page_draws_the_tenants_usage(page: BrowserPage, web_server: Server, shots: Path) -> None:
    _one_request(web_server, max_tokens=12)
    page.open("/usage", key=web_server.api_key)
    page.wait_for("document.querySelectorAll('#model-table tbody tr th').length > 0")
    expect = httpx.get(f"{web_server.url}/v1/usage", params={"by": "model", "since": "30d"},
                       headers=web_server.headers, timeout=10).json()
    rows = page.page.evaluate("[...document.querySelectorAll('#model-table tbody tr')]"
                              ".map((tr) => [...tr.children].map((c) => c.textContent))")
    assert rows == [[g["group"], *(f"{g[k]:,}" for k in ("requests", "prompt_tokens", "cached_tokens",
                                                          "completion_tokens", "total_tokens"))]
                    for g in expect["data"]]
    assert page.text("#title") == "Usage of tenant demo"
    bars = page.page.evaluate("document.querySelectorAll('#day-chart svg rect.bar').length")
    assert bars >= 2  # today's prompt and completion stacks (the legend's swatches are in their own svg)
    assert page.page.evaluate("document.querySelectorAll('#model-chart svg rect.bar').length") >= 2
    page.page.screenshot(path=str(shots / "usage.png"), full_page=True)
    assert page.errors == []


def _worker_row(bp: BrowserPage) -> dict[str, str]:
    return dict(bp.page.evaluate("""() => {
      const heads = [...document.querySelectorAll('#workers thead th')].map((th) => th.textContent);
      const cells = [...document.querySelectorAll('#workers tbody tr[data-worker] td')].map((td) => td.textContent);
      return heads.map((h, i) => [h, cells[i]]);
    }"""))


def test_operator_page_shows_workers_live(open_page: Any, web_server: Server, shots: Path) -> None:
    operator = open_page()
    operator.open("/operator", key=ADMIN_TOKEN)
    operator.wait_for("document.querySelector('#workers tbody tr[data-worker]')")
    chat = open_page()  # a second tab with a long answer, so there is something to watch
    chat.open("/", key=web_server.api_key)
    chat.wait_for("document.querySelectorAll('#model option').length > 0")
    chat.page.fill("#max_tokens", "3000")
    chat.page.fill("#prompt", "A long story, please.")
    chat.page.click("#send")
    # Live: the running request and a decode rate appear without reloading the page.
    operator.wait_for("""() => {
      const cells = [...document.querySelectorAll('#workers tbody tr[data-worker] td')];
      return cells.length > 6 && cells[2].textContent === '1' && Number(cells[6].textContent) > 0;
    }""")
    live = _worker_row(operator)
    assert live["running"] == "1" and float(live["gen tok/s"]) > 0 and live["KV usage"].endswith(" %")
    assert re.match(r"model tiny · 1 worker ready · 1 request in flight · \d+\.\d output tok/s",
                    operator.text("#summary"))
    operator.page.screenshot(path=str(shots / "operator.png"), full_page=True)
    chat.page.click("#stop")
    chat.wait_for("[...document.querySelectorAll('.msg.assistant')].at(-1).dataset.state === 'stopped'")
    operator.wait_for("""() => {
      const cells = [...document.querySelectorAll('#workers tbody tr[data-worker] td')];
      return cells[2].textContent === '0' && cells[4].textContent === '0.0 %';
    }""")
    assert worker_busy(web_server) == (0, 0)  # the same figures as /metrics (and kvgatectl top)
    assert operator.errors == [] and chat.errors == []


def test_wrong_admin_token_is_refused(page: BrowserPage) -> None:
    page.open("/operator", key="not-the-admin-token-at-all")
    page.wait_for("!document.getElementById('error').hidden")
    assert page.text("#error").startswith("Invalid admin token (401): Incorrect admin token provided.")


# ---- CORS from a real browser ----------------------------------------------------------------------------

FETCH_MODELS = """async ([url, key]) => {
  try {
    const res = await fetch(url + '/v1/models', {headers: {Authorization: 'Bearer ' + key}});
    const body = await res.json();
    return {ok: res.ok, status: res.status, models: body.data.map((m) => m.id)};
  } catch (e) {
    return {ok: false, error: String(e)};
  }
}"""


def _preflights(server: Server, status: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    pattern = re.compile(r'^kvgate:requests_total\{(?=[^}]*route="/v1/models")(?=[^}]*status="%s")[^}]*\} (\S+)$'
                         % status, re.M)
    return sum(float(v) for v in pattern.findall(text))


def test_cors_preflight_as_configured(page: BrowserPage, web_server: Server, origins: Origins) -> None:
    # A page of another web app on each origin, then a fetch that needs a preflight (it sends Authorization)
    # to the gateway, which allows origins.allowed only.
    allowed_before, refused_before = _preflights(web_server, "204"), _preflights(web_server, "403")
    page.page.goto(origins.allowed + "/app")
    assert page.page.evaluate(FETCH_MODELS, [web_server.url, web_server.api_key]) == {
        "ok": True, "status": 200, "models": ["tiny"]}
    page.page.goto(origins.other + "/app")
    refused = page.page.evaluate(FETCH_MODELS, [web_server.url, web_server.api_key])
    assert refused["ok"] is False and "Failed to fetch" in refused["error"]
    # Each fetch sent one preflight, which the gateway answered as configured.
    assert _preflights(web_server, "204") == allowed_before + 1
    assert _preflights(web_server, "403") == refused_before + 1


def test_cors_headers_as_configured(web_server: Server, origins: Origins) -> None:
    url = f"{web_server.url}/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    ok = httpx.options(url, headers={"Origin": origins.allowed, **ask}, timeout=10)
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == origins.allowed
    assert ok.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert "POST" in ok.headers["access-control-allow-methods"] and "Origin" in ok.headers["vary"]
    no = httpx.options(url, headers={"Origin": origins.other, **ask}, timeout=10)
    assert no.status_code == 403 and no.json()["error"]["code"] == "cors_origin_not_allowed"
    assert "access-control-allow-origin" not in no.headers
    models = httpx.get(f"{web_server.url}/v1/models", headers={"Origin": origins.allowed, **web_server.headers})
    assert models.headers["access-control-allow-origin"] == origins.allowed
    assert "retry-after" in models.headers["access-control-expose-headers"]
    other = httpx.get(f"{web_server.url}/v1/models", headers={"Origin": origins.other, **web_server.headers})
    assert "access-control-allow-origin" not in other.headers and "Origin" in other.headers["vary"]
    # The pages and /admin stay same-origin whatever the operator allows.
    admin = httpx.options(f"{web_server.url}/admin/workers", headers={"Origin": origins.allowed, **ask})
    assert "access-control-allow-origin" not in admin.headers


def test_readme_snippet_streams_from_an_allowed_origin(page: BrowserPage, web_server: Server,
                                                       origins: Origins) -> None:
    """The README's "From a browser" client, run as written on another web app's page the gateway allows."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## From a browser", 1)[1]
    snippet = section.split("```js\n", 1)[1].split("```", 1)[0]
    snippet = snippet.replace("http://127.0.0.1:8000", web_server.url).replace('"smollm2"', '"tiny"')
    snippet = snippet.replace("max_tokens: 256", "max_tokens: 16")  # the tiny model's answer is noise anyway
    assert "max_tokens: 16" in snippet and web_server.url in snippet
    page.page.goto(origins.allowed + "/app")
    text = page.page.evaluate("async ([key]) => { const output = document.createElement('pre');"
                              " document.body.append(output);\n" + snippet + "\nreturn output.textContent; }",
                              [web_server.api_key])
    assert isinstance(text, str) and len(text) > 0

