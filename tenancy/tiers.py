"""Tenant tiers: the plan a tenant is on, and what each tier means to the gateway. The one table of them.

A tier is a *class* of traffic with two properties:

- ``priority``: the engine priority its requests start from (vLLM's: lower runs sooner; the workers' ``priority``
  scheduling policy). A request's own ``priority`` counts from its tier's: it may place itself later (any
  positive value), never earlier (a negative value counts as 0), so no request jumps above its tenant's tier.
  ``standard`` is 0, so for the tenants every store had before tiers (migration 6 makes them ``standard``) nothing
  changes but that a negative priority no longer jumps ahead. ``interactive`` is below 0: the workers never age a
  request past 0 (``workers/core/priority.py``), so interactive traffic always goes first, and standard requests
  all at 0 keep their tenant weights (aging among requests above 0 would order them by waiting time instead).
  ``batch`` is ``BATCH_PRIORITY``'s level (the Batch API's lines): it catches up with 0 after ~100 s of waiting.
- ``capacity_share``: how much of each worker's admission bounds (``--max-queued-requests`` and
  ``--max-queued-prompt-tokens``; ``gateway/fleet/routing.py``) the tier's requests may fill, counting every
  request in flight there, whatever its tier. ``standard`` is 1 (the bounds as configured, as before tiers);
  ``batch`` is refused once a worker is half full, keeping the other half for the classes above it;
  ``interactive`` may go 25% past the bounds, headroom no other tier can take. So lower classes are refused while
  higher ones are still admitted: a tier below standard refused while the bounds as configured still have room
  gets 429 ``tier_capacity_exceeded``; a refusal at the bounds as configured is the 503 ``no_capacity`` it always
  was (a standard tenant's clients see what they saw before tiers). Tiers below standard get a retry-after of
  their own in both. It is a share of *admission*, not of compute: compute order is the priority's job, and
  shares between tenants of one tier stay their weights'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

TierName = Literal["interactive", "standard", "batch"]
DEFAULT_TIER: TierName = "standard"
MAX_PRIORITY = 2**31 - 1  # the gateway's bound on a request's priority (gateway/pipeline/protocol.py)


@dataclass(frozen=True)
class Tier:
    name: TierName
    priority: int  # the engine priority a request of this tier starts from (lower runs sooner)
    capacity_share: float  # of each worker's admission bounds, counting all requests in flight there
    description: str


# Best first: the order admission reserves headroom in and kvgatectl lists them in.
TIERS: tuple[Tier, ...] = (
    Tier("interactive", -100, 1.25, "latency first: runs before every other tier, 25% headroom past the bounds"),
    Tier("standard", 0, 1.0, "the default: the admission bounds as configured"),
    Tier("batch", 100, 0.5, "bulk: runs in the gaps, refused once a worker is half full"),
)
TIER_NAMES: tuple[TierName, ...] = tuple(t.name for t in TIERS)
_BY_NAME = {t.name: t for t in TIERS}
BASE_SHARE = _BY_NAME[DEFAULT_TIER].capacity_share  # the bounds as configured: a refusal there is a 503


def is_tier(value: object) -> bool:
    return isinstance(value, str) and value in _BY_NAME


def tier(name: str) -> Tier:
    """The tier called ``name``; raises ValueError naming the known ones."""
    if not is_tier(name):
        raise ValueError(f"unknown tier {name!r}; known: {', '.join(TIER_NAMES)}")
    return _BY_NAME[cast(TierName, name)]


# OpenAI's service_tier values and the class each asks for ("auto": the tenant's own); a request runs in the worse
# of its tenant's tier and what it asked for: it may place itself lower, never higher (as with ``priority``).
SERVICE_TIERS: dict[str, TierName | None] = {"auto": None, "default": "standard", "flex": "batch",
                                             "priority": "interactive"}
_OPENAI_NAME: dict[str, str] = {t: name for name, t in SERVICE_TIERS.items() if t is not None}


def requested_tier(tenant_tier: str, service_tier: str | None) -> str:
    """The class a request of a ``tenant_tier`` tenant runs in when it asked for ``service_tier`` (None or "auto":
    its tenant's)."""
    asked = None if service_tier is None else SERVICE_TIERS[service_tier]
    if asked is None:
        return tenant_tier
    return asked if TIER_NAMES.index(asked) > TIER_NAMES.index(tier(tenant_tier).name) else tenant_tier


def openai_service_tier(tier_name: str) -> str:
    """What a response's ``service_tier`` says for a request that ran in ``tier_name``."""
    return _OPENAI_NAME[tier(tier_name).name]


def engine_priority(tier_name: str, requested: int, floor: int | None = None) -> int:
    """The priority a request of ``tier_name`` runs at when it asked for ``requested`` (0 when it did not):
    counted from the tier's own, never above it; at least ``floor`` (a Batch API line's class) when given."""
    p = tier(tier_name).priority + max(requested, 0)
    if floor is not None:
        p = max(p, floor)
    return min(p, MAX_PRIORITY)
