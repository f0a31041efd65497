"""What a drill aims at: a gateway URL, the drill's own tenant and keys, and what can be observed there.

With an admin token the drill provisions its own tenant (``chaos-<hex>``) with two keys: ``load`` for the traffic
and ``probe`` for the checks made afterwards (slot probes, "still serving" requests), so the ledger rows of the
load are exactly those of one key. With only ``--api-key`` the drill can load but not read the ledger or slots;
those checks are skipped, never guessed.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

ADMIN_TIMEOUT_S = 30.0
_IN_FLIGHT_RE = re.compile(r"already has (\d+) requests in flight")


class ProvisionError(RuntimeError):
    pass


@dataclass
class Target:
    url: str
    api_key: str
    model: str = ""
    admin_token: str | None = None
    tenant: str | None = None
    key_id: str | None = None  # the load key's id: the ledger rows of the load
    probe_key: str | None = None
    db_path: Path | None = None  # the local store (spawned deployments): row-level ledger reads

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    async def admin(self, client: httpx.AsyncClient, method: str, path: str,
                    body: dict[str, Any] | None = None, params: dict[str, str] | None = None) -> Any:
        if not self.admin_token:
            raise ProvisionError("no admin token")
        with trio.fail_after(ADMIN_TIMEOUT_S):
            r = await client.request(method, f"{self.url}/admin{path}", json=body, params=params,
                                     headers=self.admin_headers)
        if r.status_code >= 400:
            raise ProvisionError(f"{method} /admin{path}: {r.status_code} {r.text[:300]}")
        return r.json()


async def provision(client: httpx.AsyncClient, url: str, admin_token: str, db_path: Path | None = None,
                    quota: dict[str, Any] | None = None) -> Target:
    """A fresh tenant with a load key and a probe key (and ``quota``, a PUT /admin/.../quota body)."""
    target = Target(url, "", admin_token=admin_token, db_path=db_path)
    name = "chaos-" + secrets.token_hex(4)
    await target.admin(client, "POST", "/tenants", {"name": name})
    target.tenant = name
    load = await target.admin(client, "POST", f"/tenants/{name}/keys", {"label": "chaos load"})
    probe = await target.admin(client, "POST", f"/tenants/{name}/keys", {"label": "chaos probe"})
    target.api_key, target.key_id, target.probe_key = load["key"], load["id"], probe["key"]
    if quota:
        await set_quota(client, target, quota)
    target.model = await served_model(client, url, target.api_key)
    return target


async def set_quota(client: httpx.AsyncClient, target: Target, patch: dict[str, Any]) -> dict[str, Any]:
    """Merge ``patch`` into the drill tenant's quota; returns the previous row (to put back)."""
    before = await target.admin(client, "GET", f"/tenants/{target.tenant}/quota")
    await target.admin(client, "PUT", f"/tenants/{target.tenant}/quota", patch)
    row: dict[str, Any] = before["row"]
    return row


async def served_model(client: httpx.AsyncClient, url: str, api_key: str) -> str:
    with trio.fail_after(ADMIN_TIMEOUT_S):
        r = await client.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    if r.status_code != 200 or not r.json().get("data"):
        raise ProvisionError(f"GET /v1/models: {r.status_code} {r.text[:300]}")
    return str(r.json()["data"][0]["id"])


async def slots_held(client: httpx.AsyncClient, target: Target) -> int | None:
    """Concurrency slots the drill tenant still holds, seen from outside: with its limit set to 1, one tiny
    request on the probe key is admitted when none is held, else refused with the count in its message.
    None when it cannot be observed (no admin token, or an answer that says neither)."""
    if not target.admin_token or not target.probe_key:
        return None
    # Rate limits off for the probe (a drill may have spent them): only the concurrency limit may answer.
    before = await set_quota(client, target, {"max_concurrent": 1, "rpm": None, "tpm": None})
    try:
        with trio.fail_after(60):
            r = await client.post(f"{target.url}/v1/completions",
                                  headers={"Authorization": f"Bearer {target.probe_key}"},
                                  json={"model": target.model, "prompt": "probe", "max_tokens": 1})
    finally:
        with trio.CancelScope(shield=True):
            await set_quota(client, target, {k: before.get(k) for k in ("max_concurrent", "rpm", "tpm")})
    if r.status_code == 200:
        return 0
    found = _IN_FLIGHT_RE.search(r.text)
    return int(found.group(1)) if found else None


async def still_serves(client: httpx.AsyncClient, target: Target, timeout: float = 60.0) -> tuple[bool, str]:
    """One small completion on the probe key (or the load key) answers 200 with tokens."""
    key = target.probe_key or target.api_key
    try:
        with trio.fail_after(timeout):
            r = await client.post(f"{target.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": target.model, "prompt": "Hello", "max_tokens": 4})
    except (httpx.TransportError, trio.TooSlowError) as e:
        return False, type(e).__name__
    ok = r.status_code == 200 and r.json().get("usage", {}).get("completion_tokens", 0) >= 1
    return ok, f"HTTP {r.status_code}"
