"""The playground in real Chromium against a real gateway and a tiny random-weight worker.

What the real gateway answers: a streamed chat (seen in several painted updates, equal to the same request
made without the browser), Stop (the worker frees the request's KV cache), a wrong key (401) and a rate limit
(429 with its countdown). What is crafted with Playwright's routing instead, because a random-weight model
cannot be made to say it: a completion containing ``<img src=x onerror=alert(1)>``, an error event in the middle
of a stream, and a 503. Those check the page's SSE parser and renderer, not the gateway.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tenancy.models import Quota
from tests.tenancy_support import make_tenant
from tests.test_browser_support import BrowserPage, seconds_until_idle
from tests.test_gateway_support import Server, metric_sum

pytestmark = pytest.mark.timeout(180)

LAST_ANSWER = "[...document.querySelectorAll('.msg.assistant')].at(-1)"
# Records, at every animation frame, the last answer's text whenever it changed: what was actually painted.
RECORD_FRAMES = """() => {
  window.__frames = [];
  window.__ticks = 0;
  const tick = () => {
    window.__ticks += 1;
    const msg = %s;
    const text = msg ? msg.querySelector('.text').textContent : '';
    const last = window.__frames.at(-1);
    if (text && (!last || last.text !== text)) window.__frames.push({text, state: msg.dataset.state, at: performance.now()});
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}""" % LAST_ANSWER
XSS = "<img src=x onerror=alert(1)>"


def answer_state(bp: BrowserPage, *states: str) -> str:
    return str(bp.wait_for(f"(states) => states.includes({LAST_ANSWER}?.dataset.state) && {LAST_ANSWER}.dataset.state",
                           list(states)))


def ready_to_chat(bp: BrowserPage, key: str, **params: Any) -> None:
    bp.open("/", key=key)
    bp.wait_for("document.querySelectorAll('#model option').length > 0")
    for name, value in params.items():
        bp.page.fill(f"#{name}", str(value))


def ask(bp: BrowserPage, prompt: str) -> None:
    bp.page.fill("#prompt", prompt)
    bp.page.click("#send")


def test_chat_streams_in_visible_updates_with_stats_and_export(page: BrowserPage, web_server: Server,
                                                                shots: Path) -> None:
    # Long enough (a second or two on the tiny model) that its tokens cannot all land in one painted frame.
    params = {"temperature": 0, "max_tokens": 320, "seed": 7}
    ready_to_chat(page, web_server.api_key, system="You are terse.", **params)
    page.page.evaluate(RECORD_FRAMES)
    ask(page, "Tell me about the sea.")
    assert answer_state(page, "done", "error") == "done", page.text("#error")
    frames = page.page.evaluate("window.__frames")
    painted_while_streaming = [f for f in frames if f["state"] == "streaming"]
    assert len(painted_while_streaming) >= 3, ([(f["at"], len(f["text"]), f["state"]) for f in frames],
                                               page.page.evaluate("window.__ticks"))
    text = page.page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent")
    # The same request without the browser (greedy): the page shows exactly what the model said.
    same = httpx.post(f"{web_server.url}/v1/chat/completions", headers=web_server.headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Tell me about the sea."}], **params}).json()
    assert text == same["choices"][0]["message"]["content"]
    stats = page.text(f".msg.assistant .stats")
    usage = same["usage"]
    assert re.search(r"TTFT \d+ ms · \d+\.\d tok/s", stats), stats
    assert f"prompt {usage['prompt_tokens']} · cached " in stats and "completion 320" in stats, stats
    with page.page.expect_download() as download:
        page.page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["content"] == text and exported["system"] == "You are terse."
    assert exported["messages"][1]["stats"]["completion_tokens"] == 320 and exported["params"]["seed"] == 7
    page.page.screenshot(path=str(shots / "playground.png"), full_page=True)
    assert page.errors == []


def test_stop_ends_the_stream_and_frees_the_kv_cache(page: BrowserPage, web_server: Server) -> None:
    ready_to_chat(page, web_server.api_key, max_tokens=3000, temperature=1)
    ask(page, "Write a very long story.")
    page.wait_for(f"{LAST_ANSWER}?.dataset.state === 'streaming'")
    cancelled_before = _cancellations(web_server)
    clicked = time.monotonic()
    page.page.click("#stop")
    assert answer_state(page, "stopped", "done", "error") == "stopped"
    idle_after = seconds_until_idle(web_server, clicked, within=1.5)
    shown = page.page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent")
    assert 0 < len(shown) and "stopped" in page.text(".msg.assistant .stats")
    assert _cancellations(web_server) == cancelled_before + 1
    assert page.page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent") == shown  # nothing after Stop
    assert page.page.is_enabled("#send") and not page.page.is_enabled("#stop")
    print(f"KV freed {idle_after:.2f}s after Stop")


def _cancellations(server: Server) -> float:
    return metric_sum(httpx.get(f"{server.url}/metrics", timeout=5).text, "kvgate:client_cancellations_total")


def test_wrong_key_shows_the_401_message(page: BrowserPage) -> None:
    page.open("/", key="kvg-" + "x" * 43)
    page.wait_for("!document.getElementById('error').hidden")
    assert page.text("#error").startswith("Invalid API key (401)")
    assert page.page.evaluate("sessionStorage.getItem('kvgate.apiKey')") == "kvg-" + "x" * 43
    assert page.page.evaluate("localStorage.length") == 0 and "kvg-" not in page.page.url
    page.page.click("#forget-key")
    assert page.page.evaluate("sessionStorage.getItem('kvgate.apiKey')") is None


def test_rate_limit_shows_a_retry_after_countdown(page: BrowserPage, web_server: Server) -> None:
    _, key = make_tenant(web_server, "browser-rpm1", quota=Quota(rpm=1))
    ready_to_chat(page, key, max_tokens=4)
    ask(page, "one")
    assert answer_state(page, "done", "error") == "done"
    ask(page, "two")
    page.wait_for("/Retry in \\d+ s/.test(document.getElementById('error').textContent)")
    first = page.text("#error")
    assert first.startswith("Rate limited (429)") and not page.page.is_enabled("#send")
    seconds = int(re.search(r"Retry in (\d+) s", first).group(1))  # type: ignore[union-attr]
    assert 1 <= seconds <= 60
    page.wait_for("(s) => { const m = /Retry in (\\d+) s/.exec(document.getElementById('error').textContent);"
                  " return m && Number(m[1]) < s; }", seconds)  # it counts down
    assert page.page.input_value("#prompt") == "two"  # refused: the question is back in the box


# ---- crafted responses (Playwright routing): the page's parser and renderer ----------------------------

def _sse(*events: dict[str, Any] | str) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\r\n\r\n" for e in events)


def _delta(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _fulfil_with(bp: BrowserPage, status: int, body: str, headers: dict[str, str] | None = None) -> None:
    content_type = "text/event-stream" if status == 200 else "application/json"
    bp.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=status, body=body, headers={"content-type": content_type, **(headers or {})}))


def test_markup_in_a_completion_is_shown_as_text_and_runs_nothing(open_page: Any, web_server: Server) -> None:
    # CSP bypassed on purpose: with it, an inline handler could not run whatever the renderer did.
    bp = open_page(bypass_csp=True)
    dialogs: list[str] = []


    def on_dialog(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    bp.page.on("dialog", on_dialog)
    ready_to_chat(bp, web_server.api_key)
    usage = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                       "prompt_tokens_details": {"cached_tokens": 0}}}
    # The tag split across chunks, the way tokens would split it, and a CRLF-separated stream with a ping.
    body = ": ping\r\n\r\n" + _sse(_delta(""), _delta("Here: <img src=x "), _delta("onerror=alert(1)>"),
                                   _delta(None, "stop"), usage, "[DONE]")
    _fulfil_with(bp, 200, body)
    ask(bp, "show me markup")
    assert answer_state(bp, "done", "error") == "done"
    assert bp.page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent") == "Here: " + XSS
    assert bp.page.evaluate("document.querySelectorAll('#conversation img').length") == 0
    assert "prompt 9 · cached 0 · completion 3" in bp.text(".msg.assistant .stats")
    # The control: in this context markup inserted as HTML does run its handler, so the check above means it.
    bp.page.evaluate("document.body.insertAdjacentHTML('beforeend', '<img src=x onerror=\"window.__ran=1\">')")
    bp.wait_for("window.__ran === 1")
    assert dialogs == []


def test_an_error_event_mid_stream_is_shown(page: BrowserPage, web_server: Server) -> None:
    ready_to_chat(page, web_server.api_key)
    error = {"error": {"message": "the request timed out " + XSS, "type": "server_error", "param": None,
                       "code": "timeout"}}
    _fulfil_with(page, 200, _sse(_delta("partial answer"), error, "[DONE]"))
    ask(page, "hello")
    assert answer_state(page, "error", "done") == "error"
    assert page.text("#error") == f"The stream ended with an error: the request timed out {XSS} [timeout]"
    assert page.page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.page.evaluate(f"{LAST_ANSWER}.querySelector('.text').textContent") == "partial answer"


def test_503_shows_its_retry_after(page: BrowserPage, web_server: Server) -> None:
    ready_to_chat(page, web_server.api_key)
    body = {"error": {"message": "no worker is ready to serve this model", "type": "server_error", "param": None,
                      "code": "no_worker"}}
    _fulfil_with(page, 503, json.dumps(body), {"retry-after": "5"})
    ask(page, "hello")
    page.wait_for("/Retry in \\d s/.test(document.getElementById('error').textContent)")
    assert page.text("#error").startswith("The gateway cannot take this request now (503): no worker is ready")


def test_the_csp_blocks_inline_handlers_on_the_real_page(page: BrowserPage) -> None:
    page.open("/")
    violated = page.page.evaluate("""() => new Promise((resolve) => {
      document.addEventListener('securitypolicyviolation', (e) => resolve(e.effectiveDirective), {once: true});
      document.body.insertAdjacentHTML('beforeend', '<img src=x onerror="window.__ran=1">');
    })""")
    assert violated.startswith("script-src")
    assert page.page.evaluate("window.__ran") is None


WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}]


def test_tool_calls_are_shown_and_answered_with_tool_results(page: BrowserPage, web_server: Server,
                                                             shots: Path) -> None:
    params = {"temperature": 0, "max_tokens": 120}
    ready_to_chat(page, web_server.api_key, tools=json.dumps(WEATHER_TOOL), **params)
    page.page.select_option("#tool_choice", "required")
    ask(page, "What is the weather?")
    assert answer_state(page, "done", "error") == "done", page.text("#error")
    shown = page.page.evaluate(f"[...{LAST_ANSWER}.querySelectorAll('.toolcall')].map((n) => n.textContent)")
    same = httpx.post(f"{web_server.url}/v1/chat/completions", headers=web_server.headers, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is the weather?"}], "tools": WEATHER_TOOL,
        "tool_choice": "required", **params}).json()
    calls = same["choices"][0]["message"]["tool_calls"]
    # the page accumulated the streamed deltas into what the plain request returns (greedy: the same tokens)
    assert shown == [f"→ {c['function']['name']}({c['function']['arguments']})" for c in calls]
    assert "Result of get_weather" in page.page.get_attribute("#prompt", "placeholder")
    page.page.select_option("#tool_choice", "none")  # the next turn answers in text
    for i in range(len(calls)):
        ask(page, '{"sky": "sunny"}')
        page.wait_for(f"document.querySelectorAll('.msg.tool').length === {i + 1}")
    assert answer_state(page, "done", "error") == "done", page.text("#error")
    assert page.page.evaluate(f"{LAST_ANSWER}.querySelectorAll('.toolcall').length") == 0
    with page.page.expect_download() as download:
        page.page.click("#export")
    messages = json.loads(Path(download.value.path()).read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] + ["tool"] * len(calls) + ["assistant"]
    assert [m["tool_call_id"] for m in messages[2:-1]] == [c["id"] for c in messages[1]["tool_calls"]]
    page.page.screenshot(path=str(shots / "playground-tools.png"), full_page=True)
    assert page.errors == []
