"""The rate limiter's public types: what the gateway hands a limiter (`Scope`), what it gets back (`Decision`,
`RateLimitInfo`) and the interface both backends implement (`RateLimiter`). The algorithm behind them is written
down once, in `tenancy.limits_spec`; `tenancy.limiter.Limiter` (in process) and `tenancy.redis_limiter.RedisLimiter`
(Lua in Redis) are its two implementations."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tenancy.models import Quota

DenyReason = Literal["rate_limit_exceeded", "concurrency", "insufficient_quota", "never_fits", "unavailable"]
Dimension = Literal["requests", "tokens", "budget", "concurrency"]
BudgetUsed = Callable[[str, float], int]
"""`budget_used(scope_name, since_unix)`: tokens the scope already used since then, per the ledger."""


@dataclass(frozen=True)
class Scope:
    """A counter namespace (e.g. 'tenant:ten_ab12' or 'key:key_cd34') and the quota that applies to it."""
    name: str
    quota: Quota


@dataclass(frozen=True)
class RateLimitInfo:
    """Values for OpenAI's x-ratelimit-* headers, from the most constrained scope; None where unlimited."""
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, limit, remaining, reset in (
                ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
                ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s)):
            if limit is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(reset)
        return out


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: DenyReason | None = None
    dimension: Dimension | None = None
    retry_after: float | None = None  # seconds; accurate for rpm/tpm denials
    message: str = ""
    info: RateLimitInfo = field(default_factory=RateLimitInfo)

    @property
    def http_status(self) -> int:
        if self.allowed:
            return 200
        if self.reason == "unavailable":
            return 503
        return 400 if self.reason == "never_fits" else 429

    def headers(self) -> dict[str, str]:
        out = self.info.headers()
        if self.reason == "insufficient_quota":
            out["x-should-retry"] = "false"  # OpenAI SDKs retry every 429 unless told not to
        elif self.retry_after is not None and not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
            out["retry-after-ms"] = str(math.ceil(self.retry_after * 1000))
        return out


def format_duration(seconds: float | None) -> str:
    """OpenAI's reset format: '20ms', '1s', '6m0s', '1.5s'."""
    if seconds is None or seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    rest_str = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_str}s" if minutes else f"{rest_str}s"


class RateLimiter(Protocol):
    """What the gateway calls. Every method is thread-safe; when `blocking` is True the calls do network I/O and
    the gateway runs them in a worker thread (trio.to_thread)."""
    blocking: bool

    def admit(self, request_id: str, scopes: Sequence[Scope], prompt_tokens: int, max_tokens: int) -> Decision:
        """Check every scope and, only if all allow it, reserve `prompt + max_tokens` tokens and a slot in each."""
        ...

    def settle(self, request_id: str, used_tokens: int) -> bool:
        """End of a request on any path: refund `reserved - used` (or charge overuse), free the slot. Idempotent:
        False for an unknown or already settled request (or, for a shared backend, one it could not reach)."""
        ...

    def peek(self, scopes: Sequence[Scope]) -> RateLimitInfo:
        """The x-ratelimit-* values right now, consuming nothing."""
        ...

    def renew(self) -> None:
        """Extend the leases of this process's in-flight reservations (a no-op in process)."""
        ...

    def close(self) -> None:
        ...
