"""Validation of admin input values, whatever their type (they may come straight from a JSON body or a query).

Each check returns the clean value or raises ``AdminInputError`` (a ValueError naming the offending field), which
the admin operations answer as a 400. Nothing here touches the store.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, cast

from tenancy.models import Quota, UsageGrouping, validate_tenant_name
from tenancy.tiers import TIER_NAMES, TierName, is_tier

QUOTA_FIELDS: tuple[str, ...] = tuple(f for f in Quota.__dataclass_fields__)
_INT_QUOTA_FIELDS = ("rpm", "tpm", "max_concurrent", "token_budget", "max_tokens_per_request", "max_prompt_tokens")
USAGE_GROUPINGS: tuple[UsageGrouping, ...] = ("day", "model", "key", "adapter")
MAX_INT = 2**53  # JSON-safe in every client, and far inside SQLite's 64-bit INTEGER
MAX_WEIGHT = 1e6
MAX_LABEL_CHARS = 200
MAX_REF_CHARS = 256
MAX_EXPIRY_DAYS = 36_500
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}


class AdminInputError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_ref(value: object, param: str) -> str:
    """A tenant id or name, or a key id: a non-empty string."""
    if not isinstance(value, str) or not value or len(value) > MAX_REF_CHARS:
        raise AdminInputError(f"'{param}' must be a non-empty string of at most {MAX_REF_CHARS} characters", param)
    return value


def check_name(value: object) -> str:
    name = check_ref(value, "name")
    try:
        validate_tenant_name(name)
    except ValueError as e:
        raise AdminInputError(str(e), "name") from None
    return name


def check_weight(value: object) -> float:
    if not _is_number(value) or not 0 < cast(float, value) <= MAX_WEIGHT:
        raise AdminInputError(f"'weight' must be a number in (0, {MAX_WEIGHT:g}], got {value!r}", "weight")
    return float(cast(float, value))


def check_tier(value: object) -> TierName:
    if not is_tier(value):
        raise AdminInputError(f"'tier' must be one of {', '.join(TIER_NAMES)}, got {value!r}", "tier")
    return cast(TierName, value)


def check_flag(value: object, param: str) -> bool:
    """A JSON true/false only: 0, 1 or "off" would be too easy to get backwards for a privacy switch."""
    if not isinstance(value, bool):
        raise AdminInputError(f"'{param}' must be true or false, got {value!r}", param)
    return value


def check_label(value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_LABEL_CHARS or not value.isprintable():
        raise AdminInputError(f"'label' must be a printable string of at most {MAX_LABEL_CHARS} characters", "label")
    return value


def check_expiry(expires_at: object, expires_in_days: object, now: float) -> float | None:
    """The key's expiry (unix seconds) from an absolute time or a number of days from now; None: never."""
    if expires_at is not None and expires_in_days is not None:
        raise AdminInputError("give 'expires_at' or 'expires_in_days', not both", "expires_at")
    if expires_in_days is not None:
        if not _is_number(expires_in_days) or not 0 < cast(float, expires_in_days) <= MAX_EXPIRY_DAYS:
            raise AdminInputError(f"'expires_in_days' must be a number in (0, {MAX_EXPIRY_DAYS}]", "expires_in_days")
        return now + cast(float, expires_in_days) * 86_400
    if expires_at is None:
        return None
    if not _is_number(expires_at) or not math.isfinite(cast(float, expires_at)):
        raise AdminInputError("'expires_at' must be unix seconds (a number)", "expires_at")
    if cast(float, expires_at) <= now:
        raise AdminInputError("'expires_at' is in the past", "expires_at")
    return float(cast(float, expires_at))


def _quota_value(name: str, value: object) -> Any:
    if value is None:
        return None
    if name in _INT_QUOTA_FIELDS:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT:
            raise AdminInputError(f"quota '{name}' must be an integer in [1, 2^53] or null (unlimited), "
                                  f"got {value!r}", name)
        return value
    if name == "budget_period":
        if value not in ("day", "month"):
            raise AdminInputError(f"quota 'budget_period' must be 'day', 'month' or null, got {value!r}", name)
        return value
    if (not isinstance(value, list) or not value
            or not all(isinstance(m, str) and m and len(m) <= MAX_REF_CHARS for m in value)):
        raise AdminInputError("quota 'allowed_models' must be a non-empty list of model names, "
                              "or null (every model)", name)
    return tuple(dict.fromkeys(value))


def check_quota_patch(patch: object) -> dict[str, Any]:
    """Quota fields to change: known names only; null clears a field (unlimited, or inherit for a key)."""
    if not isinstance(patch, Mapping):
        raise AdminInputError("the quota must be a JSON object")
    unknown = sorted(str(k) for k in patch if k not in QUOTA_FIELDS)
    if unknown:
        raise AdminInputError(f"unknown quota field(s) {', '.join(unknown)}; known: {', '.join(QUOTA_FIELDS)}",
                              unknown[0])
    if not patch:
        raise AdminInputError(f"no quota field given; known: {', '.join(QUOTA_FIELDS)}")
    return {name: _quota_value(name, value) for name, value in patch.items()}


def parse_since(value: object, now: float) -> float | None:
    """Unix seconds, an ISO date or date-time (UTC unless it says otherwise), or relative: 7d, 24h, 30m, 2w."""
    if value is None or value == "":
        return None
    if _is_number(value):
        value = str(value)
    if not isinstance(value, str):
        raise AdminInputError("'since' must be a string", "since")
    text = value.strip()
    relative = _RELATIVE.match(text)
    if relative:
        return now - float(relative.group(1)) * _UNIT_S[relative.group(2)]
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise AdminInputError(f"'since' must be unix seconds, an ISO date/time or a relative time like 7d or "
                              f"24h, got {value!r}", "since") from None
    return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()


def parse_grouping(value: object) -> UsageGrouping | None:
    if value is None or value == "":
        return None
    if value not in USAGE_GROUPINGS:
        raise AdminInputError(f"'by' must be one of {', '.join(USAGE_GROUPINGS)}, got {value!r}", "by")
    return value
