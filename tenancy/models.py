"""Typed records the tenancy store hands out. Frozen: callers get snapshots, never live rows."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from tenancy.tiers import DEFAULT_TIER, TierName

TenantStatus = Literal["active", "suspended"]
BudgetPeriod = Literal["day", "month"]
UsageGrouping = Literal["day", "model", "key", "adapter"]

TENANT_ID_PREFIX = "ten_"
KEY_ID_PREFIX = "key_"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def validate_tenant_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid tenant name {name!r}: 1-64 chars of letters, digits, '.', '_', '-', "
                         "starting with a letter or digit")
    if name.startswith(TENANT_ID_PREFIX):
        # Names and ids share one lookup path; a name shaped like an id would be ambiguous.
        raise ValueError(f"invalid tenant name {name!r}: must not start with {TENANT_ID_PREFIX!r}")


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    status: TenantStatus
    weight: float
    created_at: float
    log_text: bool = False  # log this tenant's prompt and completion text (off: the gateway never does)
    tier: TierName = DEFAULT_TIER  # its plan's class: engine priority and admission share (tenancy/tiers.py)


@dataclass(frozen=True)
class ApiKeyInfo:
    """What may be shown about a key: never its hash, never its plaintext."""
    id: str
    tenant_id: str
    label: str
    key_prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


@dataclass(frozen=True)
class AuthResult:
    tenant_id: str
    tenant_name: str
    tenant_status: TenantStatus  # the caller turns 'suspended' into a 403, not a 401
    key_id: str
    weight: float
    log_text: bool = False
    tier: TierName = DEFAULT_TIER


@dataclass(frozen=True)
class Quota:
    """None means unlimited (or, in a key-level row, 'inherit the tenant's value')."""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_period: BudgetPeriod | None = None
    max_tokens_per_request: int | None = None
    max_prompt_tokens: int | None = None
    allowed_models: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "token_budget", "max_tokens_per_request", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"quota {name} must be a positive integer or None (unlimited), got {value!r}")
        if self.budget_period not in (None, "day", "month"):
            raise ValueError(f"budget_period must be 'day', 'month' or None, got {self.budget_period!r}")
        if self.token_budget is not None and self.budget_period is None:
            raise ValueError("token_budget needs a budget_period ('day' or 'month')")

    def overridden_by(self, other: Quota) -> Quota:
        """Field by field: `other`'s non-None values win (a key-level row over the tenant-level row)."""
        merged = {f.name: getattr(other, f.name) if getattr(other, f.name) is not None else getattr(self, f.name)
                  for f in fields(self)}
        return Quota(**merged)


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    tenant_id: str
    key_id: str | None
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str
    started_at: float
    finished_at: float
    ttft_ms: float | None = None
    latency_ms: float | None = None
    adapter: str | None = None  # the LoRA adapter it ran with (its registered name); None: the base model

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("usage row needs a request_id (it is the idempotency key)")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"usage {name} must be >= 0, got {getattr(self, name)}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")


@dataclass(frozen=True)
class LoraAdapterRecord:
    """A registered LoRA adapter (tenancy/adapters_store.py)."""
    name: str  # what a request's `model` names
    path: str  # its directory under the gateway's --lora-dir: what workers are sent (Generate.lora)
    tenant_id: str | None  # its owner; None: global (every tenant may use it)
    created_at: float


@dataclass(frozen=True)
class UsageGroup:
    group: str  # the day (YYYY-MM-DD, UTC), model name or key id; '' when ungrouped
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
