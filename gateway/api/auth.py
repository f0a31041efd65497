"""Who is calling: API key -> tenant, key and quotas, cached briefly; failed attempts limited per address.

The store is the truth; this cache only spares it a query per request. Entries live ``ttl`` seconds (1 s by
default), so a key revoked or a quota changed by ``kvgatectl`` in another process takes effect within that
time; changes made through this gateway's admin API drop the cache at once. Only keys that authenticated are
cached (by their peppered hash, never the plaintext), so guessing cannot grow the cache. Failed attempts
spend a per-address token bucket; an address that has spent it is answered 429 before any key is checked.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import trio

from gateway.base.errors import APIError
from gateway.base.principal import Principal, build_principal
from tenancy.keys import KEY_PREFIX, hash_key, mask_key
from tenancy.models import AuthResult
from tenancy.server_secret import ServerSecret
from tenancy.store import TenancyStore

AUTH_CACHE_ENTRIES = 100_000
ADDRESS_ENTRIES = 10_000


class AddressLimiter:
    """Token bucket per client address for failed authentications (bounded LRU of addresses)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError("failed-auth limit must be >= 1 per minute")
        self._capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # addr -> (level, updated)

    def _level(self, addr: str, now: float) -> float:
        level, updated = self._buckets.get(addr, (self._capacity, now))
        return min(self._capacity, level + (now - updated) * self._rate)

    def blocked_for(self, addr: str) -> float | None:
        """Seconds until ``addr`` may try again, or None when it may try now."""
        level = self._level(addr, self._clock())
        return None if level >= 1.0 else (1.0 - level) / self._rate

    def record_failure(self, addr: str) -> None:
        now = self._clock()
        self._buckets[addr] = (self._level(addr, now) - 1.0, now)
        self._buckets.move_to_end(addr)
        while len(self._buckets) > ADDRESS_ENTRIES:
            self._buckets.popitem(last=False)


class Authenticator:
    def __init__(self, store: TenancyStore, secret: ServerSecret, *, ttl: float = 1.0,
                 failures_per_minute: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._secret = secret
        self._pepper = secret.key_pepper
        self._ttl = ttl
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Principal]] = OrderedDict()  # hash -> (expiry, who)
        self._loading: dict[str, trio.Event] = {}  # one store lookup per key at a time, however many wait
        self.failures = AddressLimiter(failures_per_minute, clock)

    def invalidate(self) -> None:
        self._cache.clear()

    async def authenticate(self, authorization: str | None, client_addr: str) -> Principal:
        """The caller behind an ``Authorization: Bearer`` header; raises APIError 401/403/429."""
        wait = self.failures.blocked_for(client_addr)
        if wait is not None:
            raise APIError(429, "too many failed authentication attempts from this address",
                           code="too_many_auth_failures", retry_after=wait)
        key = _bearer(authorization)
        principal = await self._lookup(key) if key.startswith(KEY_PREFIX) else None
        if principal is None:
            self.failures.record_failure(client_addr)
            shown = f": {mask_key(key)}" if key else ""
            hint = "" if key else " You need to provide your API key in an Authorization header (Bearer)."
            raise APIError(401, f"Incorrect API key provided{shown}.{hint}", code="invalid_api_key")
        return principal

    async def _lookup(self, key: str) -> Principal | None:
        digest = hash_key(key, self._pepper)
        while True:
            hit = self._cache.get(digest)
            if hit is not None and hit[0] > self._clock():
                return hit[1]
            loading = self._loading.get(digest)
            if loading is None:
                break
            await loading.wait()
        self._loading[digest] = done = trio.Event()
        try:
            principal = await trio.to_thread.run_sync(self._load, key)
            if principal is not None:  # unknown keys are not cached: guesses must not fill memory
                self._cache[digest] = (self._clock() + self._ttl, principal)
                self._cache.move_to_end(digest)
                while len(self._cache) > AUTH_CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            return principal
        finally:
            del self._loading[digest]
            done.set()

    async def principal_of(self, tenant_id: str, key_id: str) -> Principal:
        """The principal of a key known by id, for work it asked for earlier (a batch's lines run with the rights
        of the key that created the batch, checked again as they run, not cached). Raises the APIError a request
        with that key would get now: 401 once the key is revoked, expired or gone, 403 while its tenant is
        suspended."""
        # Abandoned on cancel: the caller bounds the wait (a hung store must not hold the batch runner).
        principal = await trio.to_thread.run_sync(self._load_by_id, tenant_id, key_id, abandon_on_cancel=True)
        if principal is None:
            raise APIError(401, "The API key that created this batch was revoked or has expired.",
                           code="invalid_api_key")
        return principal

    def _load_by_id(self, tenant_id: str, key_id: str) -> Principal | None:
        key = self._store.find_key(key_id)
        tenant = self._store.find_tenant(tenant_id)
        if key is None or tenant is None or key.tenant_id != tenant_id or key.revoked_at is not None:
            return None
        if key.expires_at is not None and time.time() >= key.expires_at:
            return None
        auth = AuthResult(tenant.id, tenant.name, tenant.status, key.id, tenant.weight, tenant.log_text, tenant.tier)
        if auth.tenant_status != "active":
            raise _suspended(auth)
        try:
            tenant_row, key_row = self._store.quota_rows(tenant_id, key_id)
        except KeyError:  # the tenant was deleted between the queries
            return None
        return build_principal(auth, tenant_row, key_row, self._secret.cache_salt(tenant_id))

    def _load(self, key: str) -> Principal | None:
        auth = self._store.authenticate(key)
        if auth is None:
            return None
        if auth.tenant_status != "active":
            raise _suspended(auth)
        try:
            tenant_row, key_row = self._store.quota_rows(auth.tenant_id, auth.key_id)
        except KeyError:  # the tenant was deleted between the two queries
            return None
        return build_principal(auth, tenant_row, key_row, self._secret.cache_salt(auth.tenant_id))


def _suspended(auth: AuthResult) -> APIError:
    return APIError(403, f"tenant {auth.tenant_name!r} is suspended; contact your administrator",
                    code="tenant_suspended")


def _bearer(header: str | None) -> str:
    scheme, _, key = (header or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
