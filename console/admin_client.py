"""``kvgatectl --url``: the AdminBackend that calls a running gateway's ``/admin`` API over HTTP (httpx).

The gateway answers with ``tenancy.admin_ops``'s JSON shapes, so results pass through untouched. An error
answer (OpenAI's shape) or no answer at all becomes an ``AdminOpError`` with the gateway's message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from tenancy.admin_ops import AdminOpError, Json
from tenancy.tiers import DEFAULT_TIER

DEFAULT_TIMEOUT_S = 30.0


def _seg(value: str) -> str:
    return quote(value, safe="")


def _drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class RemoteAdmin:
    def __init__(self, url: str, admin_token: str | None, *, timeout: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._url = url.rstrip("/")
        self._http = httpx.Client(base_url=self._url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, body: Mapping[str, Any] | None = None,
              params: Mapping[str, Any] | None = None, prefix: str = "/admin") -> Json:
        try:
            resp = self._http.request(method, prefix + path, json=body, params=_drop_none(params or {}))
        except httpx.TransportError as e:
            reason = str(e) or type(e).__name__
            raise AdminOpError(0, f"cannot reach the gateway at {self._url}: {reason}",
                               code="connection_error") from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.is_success and isinstance(data, dict):
            return data
        raise _error(resp, data)

    def list_tenants(self) -> Json:
        return self._call("GET", "/tenants")

    def create_tenant(self, name: str, weight: float = 1.0, tier: str = DEFAULT_TIER) -> Json:
        # The default tier is left out: a gateway from before tiers refuses the field, and means the same.
        extra = {} if tier == DEFAULT_TIER else {"tier": tier}
        return self._call("POST", "/tenants", body={"name": name, "weight": weight, **extra})

    def show_tenant(self, ref: str) -> Json:
        return self._call("GET", f"/tenants/{_seg(ref)}")

    def suspend_tenant(self, ref: str) -> Json:
        return self._call("POST", f"/tenants/{_seg(ref)}/suspend")

    def resume_tenant(self, ref: str) -> Json:
        return self._call("POST", f"/tenants/{_seg(ref)}/resume")

    def update_tenant(self, ref: str, weight: float) -> Json:
        return self._call("PATCH", f"/tenants/{_seg(ref)}", body={"weight": weight})

    def set_log_text(self, ref: str, on: bool) -> Json:
        return self._call("PATCH", f"/tenants/{_seg(ref)}", body={"log_text": on})

    def set_tier(self, ref: str, tier: str) -> Json:
        return self._call("PATCH", f"/tenants/{_seg(ref)}", body={"tier": tier})

    def tiers(self) -> Json:
        return self._call("GET", "/tiers")

    def delete_tenant(self, ref: str) -> Json:
        return self._call("DELETE", f"/tenants/{_seg(ref)}")

    def create_key(self, tenant: str, label: str = "", expires_at: float | None = None,
                   expires_in_days: float | None = None) -> Json:
        body = _drop_none({"label": label, "expires_at": expires_at, "expires_in_days": expires_in_days})
        return self._call("POST", f"/tenants/{_seg(tenant)}/keys", body=body)

    def list_keys(self, tenant: str | None = None) -> Json:
        if tenant is None:
            return self._call("GET", "/keys")
        return self._call("GET", f"/tenants/{_seg(tenant)}/keys")

    def revoke_key(self, key_id: str) -> Json:
        return self._call("POST", f"/keys/{_seg(key_id)}/revoke")

    def get_quota(self, tenant: str, key_id: str | None = None) -> Json:
        return self._call("GET", f"/tenants/{_seg(tenant)}/quota", params={"key_id": key_id})

    def update_quota(self, tenant: str, patch: Mapping[str, Any], key_id: str | None = None) -> Json:
        return self._call("PUT", f"/tenants/{_seg(tenant)}/quota", body=patch, params={"key_id": key_id})

    def usage(self, tenant: str | None = None, since: str | None = None, by: str | None = None) -> Json:
        return self._call("GET", "/usage", params={"tenant": tenant, "since": since, "by": by})

    # ---- LoRA adapters: registered at vLLM's paths (the gateway checks them against its base model) ----

    def list_adapters(self, tenant: str | None = None) -> Json:
        return self._call("GET", "/adapters", params={"tenant": tenant})

    def load_adapter(self, name: str, path: str, tenant: str | None = None) -> Json:
        body = _drop_none({"lora_name": name, "lora_path": path, "tenant": tenant})
        return self._call("POST", "/v1/load_lora_adapter", body=body, prefix="")

    def unload_adapter(self, name: str) -> Json:
        return self._call("POST", "/v1/unload_lora_adapter", body={"lora_name": name}, prefix="")

    # ---- the gateway's workers (no store behind these: remote mode only) ----

    def workers(self) -> Json:
        return self._call("GET", "/workers")

    def drain_worker(self, worker_id: str, timeout: float | None = None) -> Json:
        return self._call("POST", f"/workers/{_seg(worker_id)}/drain", body=_drop_none({"timeout": timeout}))


def _error(resp: httpx.Response, data: object) -> AdminOpError:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code")
        param = error.get("param")
        return AdminOpError(resp.status_code, error["message"], code=code if isinstance(code, str) else "error",
                            param=param if isinstance(param, str) else None)
    return AdminOpError(resp.status_code, f"the gateway answered HTTP {resp.status_code} {resp.reason_phrase}",
                        code="http_error")
