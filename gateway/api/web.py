"""The gateway's browser edge: the playground, usage and operator pages, their static files, the security
headers every response carries, CORS for the API, and the operator's JSON view of the workers.

    GET /, /playground     chat playground (a tenant key, kept in the tab's sessionStorage)
    GET /usage             the key's own tenant usage, from /v1/usage
    GET /operator          live worker table (the admin token), from GET /admin/workers
    GET /assets/<file>     the pages' JS, CSS and HTML parts: plain files in the package, no CDN, no build step
    GET /admin/workers     JSON: every live worker's state (ready, draining), Hello and last Stats, sampled now

Pages load scripts from 'self' only: the Content-Security-Policy forbids inline script, so text that reaches
the DOM as markup by mistake still cannot run. CORS is off unless the operator names origins (--cors-origin):
a preflight from any other origin gets a 403 and no Access-Control-* header, so the browser refuses the call.
"""

from __future__ import annotations

import dataclasses
import enum
import html
import math
import re
import string
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from quart import Blueprint, Response, request

from gateway.api.admin import authorize_admin
from gateway.api.http_json import json_response
from gateway.api.state import GatewayState
from gateway.base.errors import APIError
from gateway.fleet.worker_state import WorkerState

STATIC_DIR = Path(__file__).with_name("static")


@dataclasses.dataclass(frozen=True)
class Page:
    title: str  # also its name in the navigation bar
    name: str  # static/<name>.js and static/<name>.main.html
    secret: str  # what the page asks for: a tenant's API key or the admin token
    placeholder: str


_PLAYGROUND = Page("Playground", "playground", "API key", "kvg-…")
_USAGE = Page("Usage", "usage", "API key", "kvg-…")
_OPERATOR = Page("Operator", "operator", "Admin token", "--admin-token")
PAGES = {"/": _PLAYGROUND, "/playground": _PLAYGROUND, "/usage": _USAGE, "/operator": _OPERATOR}
_NAV = (("/playground", _PLAYGROUND), ("/usage", _USAGE), ("/operator", _OPERATOR))


def render_page(page: Page) -> bytes:
    """One page: the shared layout (head, navigation, key bar) around the page's own <main>. Composed once at
    start-up from plain files, so the pages share their frame without a build step or a template engine."""
    current = ' aria-current="page"'
    nav = "".join(f'<a href="{href}"{current if p is page else ""}>{html.escape(p.title)}</a>' for href, p in _NAV)
    main = (STATIC_DIR / f"{page.name}.main.html").read_text()
    noun = "token" if "token" in page.secret else "key"
    layout = string.Template((STATIC_DIR / "layout.html").read_text())
    return layout.substitute(title=html.escape(page.title.lower()), script=f"{page.name}.js", nav=nav,
                             secret=html.escape(page.secret), placeholder=html.escape(page.placeholder),
                             noun=noun, main=main).encode()

# One policy for every response: JSON and event streams need no more than the pages do. 'self' for scripts,
# styles and fetches; no inline script or style, no plugins, no framing, no form posts (the key never leaves
# in a form), no <base> hijack. SVG charts are built with DOM calls, so no 'unsafe-inline' is needed.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # page URLs carry nothing secret, but nothing needs them either
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Cross-Origin-Opener-Policy": "same-origin",
}

# CORS covers the tenant API only; /admin and the pages stay same-origin whatever the operator allows.
CORS_PATHS = ("/v1/", "/tokenize", "/detokenize")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type"
# What a browser client needs to read to back off and to show quotas (the rest of the headers it cannot see).
CORS_EXPOSE = ("retry-after, retry-after-ms, x-should-retry, x-ratelimit-limit-requests, "
               "x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-ratelimit-limit-tokens, "
               "x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens")
CORS_MAX_AGE_S = 600
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    origins: frozenset[str]  # exact origins, or "*" for any

    def allows(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    @staticmethod
    def covers(path: str) -> bool:
        return path.startswith(CORS_PATHS)


def _preflight_headers(origin: str, requested: str | None) -> dict[str, str]:
    # Echo the requested header names (the openai JS SDK sends x-stainless-* ones) once the origin is trusted;
    # anything that is not a plain list of header names gets the fixed list instead.
    allow_headers = requested.strip() if requested and _HEADER_LIST.fullmatch(requested.strip()) else None
    return {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": allow_headers or CORS_DEFAULT_HEADERS,
            "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"}


def create_web_blueprint(state: GatewayState) -> Blueprint:
    bp = Blueprint("web", __name__, static_folder="static", static_url_path="/assets")
    cors = CorsPolicy(frozenset(state.config.cors_origins))
    admin_token = state.config.tenancy.admin_token
    pages = {rule: render_page(page) for rule, page in PAGES.items()}  # composed once: a few KB each

    async def page() -> Response:
        response = Response(pages[request.url_rule.rule if request.url_rule else "/"],
                            content_type="text/html; charset=utf-8")
        response.headers["Cache-Control"] = "no-cache"  # a new release's page must not pair with old scripts
        return response

    for rule in PAGES:
        bp.add_url_rule(rule, f"page{rule.replace('/', '_')}", page, methods=["GET"])

    @bp.before_app_request
    async def cors_preflight() -> Response | None:
        if (request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers
                or not cors.covers(request.path)):
            return None
        origin = request.headers.get("Origin")
        if not cors.allows(origin) or origin is None:
            raise APIError(403, "cross-origin requests from this origin are not allowed; the operator allows "
                                "origins with --cors-origin", code="cors_origin_not_allowed")
        return Response("", status=204,
                        headers=_preflight_headers(origin, request.headers.get("Access-Control-Request-Headers")))

    @bp.after_app_request
    async def add_headers(response: Response) -> Response:
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if cors.origins and cors.covers(request.path) and request.method != "OPTIONS":
            response.vary.add("Origin")  # the answer differs by origin: caches must not share it
            origin = request.headers.get("Origin")
            if origin is not None and cors.allows(origin):
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE
        return response

    @bp.get("/admin/workers")
    async def workers() -> Response:
        authorize_admin(admin_token)
        return json_response(workers_json(state))

    return bp


# --- the operator's JSON -----------------------------------------------------------------------------------

def workers_json(state: GatewayState) -> dict[str, Any]:
    """The pool's worker table as the operator page reads it. Counters are cumulative, as in /metrics: the
    page turns two samples into rates over ``sampled_at`` (the gateway's monotonic clock) as ``kvgatectl top``
    does, so both show the same tokens/s."""
    pool = state.pool
    now = trio.current_time()
    aborts = pool.pending_aborts()
    rows = [_worker_json(w, now, aborts.get(w.worker_id, 0))
            for w in sorted(pool.workers.values(), key=lambda w: w.worker_id)]
    return {"object": "list", "model": state.config.model_name, "sampled_at": now, "time": time.time(),
            "workers_ready": len(rows), "requests_in_flight": pool.num_inflight, "data": rows}


def _worker_json(w: WorkerState, now: float, pending_aborts: int) -> dict[str, Any]:
    stats, counts = _split_fields(w.stats) if w.stats is not None else ({}, {})
    return {"worker": w.worker_id, "state": "draining" if w.draining else "ready",
            "hello": _split_fields(w.hello)[0], "in_flight": len(w.requests),
            "prompt_tokens_in_flight": w.prompt_tokens, "pending_outputs": w.pending_outputs(),
            "pending_aborts": pending_aborts, "seconds_since_heartbeat": round(max(0.0, now - w.last_seen), 3),
            "live_seconds": round(max(0.0, now - w.joined), 3), "stats": stats, "stats_counts": counts}


def _split_fields(message: object) -> tuple[dict[str, Any], dict[str, int]]:
    """A message's scalar fields, and the sizes of its list/dict fields (request id lists would swamp the page
    and say nothing an operator needs beyond their number). Read generically: fields the workers add later
    (step progress, health) show up without a change here."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        items: Mapping[str, object] = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    else:  # a msgspec Struct or any object with named slots
        names: tuple[str, ...] = tuple(getattr(message, "__struct_fields__", None)
                                       or getattr(message, "__slots__", None) or ())
        items = {n: getattr(message, n) for n in names if hasattr(message, n)}
    scalars: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for name, value in items.items():
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            counts[name] = len(value)
        else:
            scalars[name] = _scalar(value)
    return scalars, counts


def _scalar(value: object) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # JSON has no NaN
    return str(value)
