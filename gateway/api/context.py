"""What every route module shares: the app's ``GatewayState`` (bound once by ``create_app``), the bearer-key check
and the ``model`` field check. Route handlers are plain functions; they reach the state through ``app_state``."""

from __future__ import annotations

from typing import Any, cast

from quart import current_app, g, request
from quart_trio import QuartTrio

from gateway.api.state import GatewayState
from gateway.base.errors import APIError, bad_request, model_not_allowed, model_not_found
from gateway.base.principal import Principal
from tenancy.models import LoraAdapterRecord

STATE_KEY = "kvgate.state"


def bind_state(app: QuartTrio, state: GatewayState) -> None:
    app.extensions[STATE_KEY] = state


def app_state() -> GatewayState:
    return cast(GatewayState, current_app.extensions[STATE_KEY])


def current_trio_app() -> QuartTrio:
    # current_app is typed as plain Quart; create_app only ever builds a QuartTrio (its nursery runs the streams).
    return cast(QuartTrio, current_app._get_current_object())  # type: ignore[attr-defined]


def client_addr() -> str:
    # The peer of this connection. Behind a proxy that is the proxy: trusting X-Forwarded-For is a
    # deployment decision (not made here), since any client can send one.
    remote = request.scope.get("client")
    return str(remote[0]) if remote else "unknown"


async def authorize() -> Principal:
    state = app_state()
    gm = state.metrics
    try:
        principal = await state.tenancy.auth.authenticate(request.headers.get("Authorization"), client_addr())
    except APIError as e:
        if e.status == 403:  # the key is fine, its tenant is suspended: a refusal, not a failed login
            gm.rejected.labels("", e.code or "forbidden").inc()
        else:
            gm.auth_failures.labels(e.code or "unknown").inc()
        raise
    g.principal = principal
    return principal


async def check_model(body: Any, principal: Principal) -> LoraAdapterRecord | None:
    """The body's ``model``: the served base model (None) or a LoRA adapter this tenant may use (vLLM's convention:
    an adapter is a model). Another tenant's adapter is answered exactly as a name nobody registered."""
    state = app_state()
    served = state.config.model_name
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", param="model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    adapter = None if model == served else await state.tenancy.adapters.resolve(model, principal.tenant_id)
    if model != served and adapter is None:
        raise model_not_found(model)
    if not principal.allows_model(model):
        raise model_not_allowed(model)
    return adapter

