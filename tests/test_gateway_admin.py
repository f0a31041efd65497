"""gateway.api.admin: the /admin JSON API over a real tenancy store, through Quart's test client (no network).

Auth (401 / 403 disabled / tenant keys refused), tenant/key/quota CRUD, validation answered as OpenAI-shaped
4xx (never a 500), on_change after every successful mutation and only then, and usage filters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gateway.api.admin import create_admin_blueprint
from gateway.base.errors import APIError, error_body
from tenancy.models import UsageRow
from tenancy.store import TenancyStore

TOKEN = "admin-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DAY = 86_400.0
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def make_admin_app(store: TenancyStore, token: str | None, on_change: Any = lambda: None) -> QuartTrio:
    """A QuartTrio app with the admin blueprint and the main app's error-handler pattern."""
    app = QuartTrio("kvgate-admin-test")
    app.register_blueprint(create_admin_blueprint(store, token, on_change))

    def render(e: APIError) -> Response:
        return Response(json.dumps(e.body()), status=e.status, headers=e.headers(), content_type="application/json")

    @app.errorhandler(APIError)
    async def on_api_error(e: APIError) -> Response:
        return render(e)

    @app.errorhandler(HTTPException)
    async def on_http_error(e: HTTPException) -> Response:
        return render(APIError(e.code or 500, e.description or e.name))

    @app.errorhandler(Exception)
    async def on_unexpected(e: Exception) -> Response:
        return Response(json.dumps(error_body("internal server error", "server_error")), status=500,
                        content_type="application/json")

    return app


class Changes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TenancyStore]:
    s = TenancyStore(tmp_path / "kvgate.db", b"test-pepper")
    yield s
    s.close()


@pytest.fixture
def changes() -> Changes:
    return Changes()


@pytest.fixture
def app(store: TenancyStore, changes: Changes) -> QuartTrio:
    return make_admin_app(store, TOKEN, changes)


async def call(app: QuartTrio, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
               raw: str | None = None, query: dict[str, str] | None = None) -> tuple[int, Any]:
    client = app.test_client()
    kwargs: dict[str, Any] = {"headers": AUTH if headers is None else headers, "query_string": query}
    if raw is not None:
        kwargs["data"] = raw
    elif body is not None:
        kwargs["json"] = body
    resp = await client.open(path, method=method, **kwargs)
    return resp.status_code, await resp.get_json()


def assert_error(status: int, data: Any, want_status: int, code: str | None = None) -> None:
    assert status == want_status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["message"]
    if code is not None:
        assert data["error"]["code"] == code


@pytest.mark.trio
async def test_auth_disabled_wrong_token_and_tenant_key(store: TenancyStore) -> None:
    disabled = make_admin_app(store, None)
    status, data = await call(disabled, "GET", "/admin/tenants")
    assert_error(status, data, 403, "admin_disabled")
    assert "--admin-token" in data["error"]["message"] and "KVGATE_ADMIN_TOKEN" in data["error"]["message"]

    app = make_admin_app(store, TOKEN)
    tenant = store.create_tenant("acme")
    _, plaintext = store.create_key(tenant.id, "k")
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {plaintext}"}):
        status, data = await call(app, "GET", "/admin/tenants", headers=headers)
        assert_error(status, data, 401, "invalid_admin_token")
    status, data = await call(app, "GET", "/admin/tenants")
    assert status == 200 and [t["name"] for t in data["data"]] == ["acme"]


@pytest.mark.trio
async def test_tenant_and_key_lifecycle(app: QuartTrio, store: TenancyStore, changes: Changes) -> None:
    status, t = await call(app, "POST", "/admin/tenants", {"name": "acme", "weight": 2})
    assert status == 201 and t["name"] == "acme" and t["weight"] == 2.0 and t["status"] == "active"
    assert changes.count == 1
    assert_error(*await call(app, "POST", "/admin/tenants", {"name": "acme"}), 409, "tenant_exists")
    status, lst = await call(app, "GET", "/admin/tenants")
    assert lst == {"object": "list", "data": [t]}

    status, t2 = await call(app, "PATCH", f"/admin/tenants/{t['id']}", {"weight": 0.5})
    assert status == 200 and t2["weight"] == 0.5
    assert (await call(app, "POST", "/admin/tenants/acme/suspend"))[1]["status"] == "suspended"
    assert (await call(app, "POST", "/admin/tenants/acme/resume"))[1]["status"] == "active"

    status, key = await call(app, "POST", "/admin/tenants/acme/keys", {"label": "ci", "expires_in_days": 30})
    assert status == 201 and key["key"].startswith("kvg-") and key["status"] == "active"
    assert key["expires_at"] == pytest.approx(key["created_at"] + 30 * DAY, abs=5)
    auth = store.authenticate(key["key"])
    assert auth is not None and auth.tenant_name == "acme" and auth.key_id == key["id"]
    _, keys = await call(app, "GET", "/admin/tenants/acme/keys")
    _, all_keys = await call(app, "GET", "/admin/keys")
    assert keys == all_keys and [k["id"] for k in keys["data"]] == [key["id"]]
    assert "key" not in keys["data"][0] and key["key"] not in json.dumps(keys)
    _, shown = await call(app, "GET", "/admin/tenants/acme")
    assert shown["keys"] == keys["data"] and shown["quota"]["rpm"] is None

    status, revoked = await call(app, "POST", f"/admin/keys/{key['id']}/revoke")
    assert status == 200 and revoked["status"] == "revoked" and revoked["was_active"] is True
    assert store.authenticate(key["key"]) is None
    assert (await call(app, "POST", f"/admin/keys/{key['id']}/revoke"))[1]["was_active"] is False

    before = changes.count
    status, gone = await call(app, "DELETE", "/admin/tenants/acme")
    assert status == 200 and gone == {"id": t["id"], "name": "acme", "deleted": True}
    assert changes.count == before + 1
    assert_error(*await call(app, "GET", "/admin/tenants/acme"), 404, "tenant_not_found")
    # 1 create + patch + suspend + resume + key + 2 revokes + delete; the refused create and the GETs: none
    assert changes.count == 8


BAD_REQUESTS: list[tuple[str, str, str, Any, int]] = [
    ("unknown field", "POST", "/admin/tenants", {"name": "x", "colour": "red"}, 400),
    ("name wrong type", "POST", "/admin/tenants", {"name": 7}, 400),
    ("missing name", "POST", "/admin/tenants", {}, 400),
    ("bad name", "POST", "/admin/tenants", {"name": "bad name!"}, 400),
    ("id-shaped name", "POST", "/admin/tenants", {"name": "ten_abc"}, 400),
    ("negative weight", "POST", "/admin/tenants", {"name": "x", "weight": -1}, 400),
    ("bool weight", "PATCH", "/admin/tenants/acme", {"weight": True}, 400),
    ("empty patch", "PATCH", "/admin/tenants/acme", {}, 400),
    ("body not object", "POST", "/admin/tenants", [1, 2], 400),
    ("invalid json", "POST", "/admin/tenants", "{nope", 400),
    ("NaN", "PATCH", "/admin/tenants/acme", '{"weight": NaN}', 400),
    ("string log_text", "PATCH", "/admin/tenants/acme", {"log_text": "on"}, 400),
    ("int log_text", "PATCH", "/admin/tenants/acme", {"log_text": 1}, 400),
    ("null log_text", "PATCH", "/admin/tenants/acme", {"log_text": None}, 400),
    ("weight and log_text", "PATCH", "/admin/tenants/acme", {"weight": 2, "log_text": True}, 400),
    ("unknown tenant log_text", "PATCH", "/admin/tenants/nope", {"log_text": True}, 404),
    ("unknown tenant", "GET", "/admin/tenants/nope", None, 404),
    ("unknown tenant keys", "POST", "/admin/tenants/nope/keys", {"label": "x"}, 404),
    ("unknown key", "POST", "/admin/keys/key_nope/revoke", None, 404),
    ("both expiries", "POST", "/admin/tenants/acme/keys", {"expires_at": 1e12, "expires_in_days": 1}, 400),
    ("past expiry", "POST", "/admin/tenants/acme/keys", {"expires_at": 1}, 400),
    ("label type", "POST", "/admin/tenants/acme/keys", {"label": ["x"]}, 400),
    ("negative rpm", "PUT", "/admin/tenants/acme/quota", {"rpm": -5}, 400),
    ("float rpm", "PUT", "/admin/tenants/acme/quota", {"rpm": 1.5}, 400),
    ("huge tpm", "PUT", "/admin/tenants/acme/quota", {"tpm": 2**70}, 400),
    ("unknown quota field", "PUT", "/admin/tenants/acme/quota", {"rps": 5}, 400),
    ("budget without period", "PUT", "/admin/tenants/acme/quota", {"token_budget": 100}, 400),
    ("bad period", "PUT", "/admin/tenants/acme/quota", {"token_budget": 100, "budget_period": "week"}, 400),
    ("empty models", "PUT", "/admin/tenants/acme/quota", {"allowed_models": []}, 400),
    ("empty quota", "PUT", "/admin/tenants/acme/quota", {}, 400),
    ("unknown key quota", "GET", "/admin/tenants/acme/quota?key_id=key_nope", None, 404),
    ("bad since", "GET", "/admin/usage?since=yesterday", None, 400),
    ("bad by", "GET", "/admin/usage?by=hour", None, 400),
    ("unknown query", "GET", "/admin/usage?tenantt=acme", None, 400),
]


@pytest.mark.trio
@pytest.mark.parametrize("name, method, path, body, want", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
async def test_bad_input_is_4xx_in_openai_shape(app: QuartTrio, store: TenancyStore, changes: Changes, name: str,
                                                method: str, path: str, body: Any, want: int) -> None:
    store.create_tenant("acme")
    path, _, qs = path.partition("?")
    query = dict(p.split("=", 1) for p in qs.split("&")) if qs else None
    raw = body if isinstance(body, str) else None
    status, data = await call(app, method, path, None if raw else body, raw=raw, query=query)
    assert_error(status, data, want)
    assert changes.count == 0
    if want == 400:
        assert data["error"]["type"] == "invalid_request_error"


@pytest.mark.trio
async def test_patch_log_text_on_and_off(app: QuartTrio, store: TenancyStore, changes: Changes) -> None:
    status, t = await call(app, "POST", "/admin/tenants", {"name": "acme"})
    assert status == 201 and t["log_text"] is False
    status, on = await call(app, "PATCH", "/admin/tenants/acme", {"log_text": True})
    assert status == 200 and on == {**t, "log_text": True}
    assert store.get_tenant("acme").log_text is True
    _, listed = await call(app, "GET", "/admin/tenants")
    _, shown = await call(app, "GET", f"/admin/tenants/{t['id']}")
    assert listed["data"] == [on] and shown["log_text"] is True
    status, off = await call(app, "PATCH", f"/admin/tenants/{t['id']}", {"log_text": False})
    assert status == 200 and off == t and store.get_tenant("acme").log_text is False
    assert changes.count == 3  # create + two patches: each drops the gateway's auth cache


@pytest.mark.trio
async def test_quota_put_merges_and_null_clears(app: QuartTrio, store: TenancyStore, changes: Changes) -> None:
    tenant = store.create_tenant("acme")
    other = store.create_tenant("other")
    key_id, _ = store.create_key(tenant.id, "k")
    foreign_key, _ = store.create_key(other.id, "k")
    _, q = await call(app, "PUT", "/admin/tenants/acme/quota", {"rpm": 10, "allowed_models": ["a", "b"]})
    _, q = await call(app, "PUT", "/admin/tenants/acme/quota", {"tpm": 1000, "token_budget": 5, "budget_period": "day"})
    assert q["scope"] == "tenant" and q["key_id"] is None
    assert q["row"] == q["effective"] == {"rpm": 10, "tpm": 1000, "max_concurrent": None, "token_budget": 5,
                                          "budget_period": "day", "max_tokens_per_request": None,
                                          "max_prompt_tokens": None, "allowed_models": ["a", "b"]}
    _, q = await call(app, "PUT", "/admin/tenants/acme/quota", {"rpm": None, "allowed_models": None})
    assert q["row"]["rpm"] is None and q["row"]["allowed_models"] is None and q["row"]["tpm"] == 1000

    status, kq = await call(app, "PUT", "/admin/tenants/acme/quota", {"rpm": 3}, query={"key_id": key_id})
    assert status == 200 and kq["scope"] == "key" and kq["key_id"] == key_id
    assert kq["row"]["rpm"] == 3 and kq["row"]["tpm"] is None
    assert kq["effective"]["rpm"] == 3 and kq["effective"]["tpm"] == 1000
    assert (await call(app, "GET", "/admin/tenants/acme/quota", query={"key_id": key_id}))[1] == kq
    assert store.get_quota(tenant.id, key_id).rpm == 3
    assert changes.count == 4
    status, data = await call(app, "PUT", "/admin/tenants/acme/quota", {"rpm": 3}, query={"key_id": foreign_key})
    assert_error(status, data, 404, "key_not_found")


@pytest.mark.trio
async def test_usage_filters(app: QuartTrio, store: TenancyStore) -> None:
    a, b = store.create_tenant("a"), store.create_tenant("b")
    rows = [UsageRow("r1", a.id, "key_1", "m1", 10, 2, 5, "stop", T0, T0 + 1),
            UsageRow("r2", a.id, "key_2", "m2", 20, 0, 5, "stop", T0 + DAY, T0 + DAY + 1),
            UsageRow("r3", b.id, None, "m1", 1, 0, 1, "stop", T0 + 2 * DAY, T0 + 2 * DAY + 1)]
    store.record_usage(rows)
    _, total = await call(app, "GET", "/admin/usage")
    assert total["data"] == [{"group": "", "requests": 3, "prompt_tokens": 31, "cached_tokens": 2,
                              "completion_tokens": 11, "total_tokens": 42}]
    assert total["tenant_id"] is None and total["since"] is None and total["by"] is None
    _, by_model = await call(app, "GET", "/admin/usage", query={"tenant": "a", "by": "model"})
    assert by_model["tenant_id"] == a.id
    assert [(g["group"], g["total_tokens"]) for g in by_model["data"]] == [("m1", 15), ("m2", 25)]
    _, by_day = await call(app, "GET", "/admin/usage", query={"by": "day", "since": str(T0 + DAY)})
    assert [g["group"] for g in by_day["data"]] == ["2023-11-15", "2023-11-16"]
    _, iso = await call(app, "GET", "/admin/usage", query={"by": "key", "since": "2023-11-15T00:00:00Z"})
    assert [g["group"] for g in iso["data"]] == ["", "key_2"] and iso["since"] == T0 + DAY - 22 * 3600 - 800
    _, recent = await call(app, "GET", "/admin/usage", query={"since": "7d"})
    assert recent["data"] == [] and recent["since"] > T0
    assert_error(*await call(app, "GET", "/admin/usage", query={"tenant": "zzz"}), 404)
