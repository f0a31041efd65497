"""Who is calling, once authenticated: the ``Principal`` every layer that spends or accounts for a request reads
(the routes, admission and its account, the Batch API runner). Built from the store's rows by ``build_principal``; the
lookup itself (keys, cache, failed attempts) is ``gateway/api/auth.py``'s ``Authenticator``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tenancy.limiter import Scope
from tenancy.models import AuthResult, Quota
from tenancy.tiers import DEFAULT_TIER, TierName


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant, its key, the effective quota and the limiter scopes it spends."""

    tenant_id: str
    tenant_name: str
    key_id: str
    weight: float
    cache_salt: str  # opaque to workers; scopes the prefix cache to this tenant
    quota: Quota  # effective: the key's own fields over the tenant's
    scopes: tuple[Scope, ...]
    log_text: bool  # the tenant opted in to prompt/completion text in its request_finished lines
    tier: TierName = DEFAULT_TIER  # the tenant's plan: its requests' priority and admission share (tenancy/tiers.py)

    def allows_model(self, model: str) -> bool:
        return self.quota.allowed_models is None or model in self.quota.allowed_models


def build_principal(auth: AuthResult, tenant_row: Quota, key_row: Quota | None, salt: str) -> Principal:
    """Rates, concurrency and budgets count per scope: the tenant's cover all its keys, a key's own row covers
    that key. Per-request bounds (max prompt, max tokens) follow the effective quota, where a key's value
    overrides the tenant's, so they ride on the tenant scope and are cleared from the key scope."""
    effective = tenant_row if key_row is None else tenant_row.overridden_by(key_row)
    scopes = [Scope(f"tenant:{auth.tenant_id}", replace(
        tenant_row, max_prompt_tokens=effective.max_prompt_tokens,
        max_tokens_per_request=effective.max_tokens_per_request))]
    if key_row is not None:
        scopes.append(Scope(f"key:{auth.key_id}", replace(key_row, max_prompt_tokens=None,
                                                          max_tokens_per_request=None)))
    return Principal(auth.tenant_id, auth.tenant_name, auth.key_id, auth.weight, salt, effective, tuple(scopes),
                     auth.log_text, auth.tier)
