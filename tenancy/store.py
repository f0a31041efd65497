"""The tenancy store: tenants, API keys, quotas and the usage ledger, over SQLite or PostgreSQL.

The store's logic and SQL live here once; a backend (tenancy/db_sqlite.py, the embedded default, or
tenancy/db_postgres.py, selected by a `postgresql://` URL) runs the transactions and supplies the few spellings
that differ (tenancy/db_backend.py). Every write is one transaction: it lands whole or not at all.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tenancy.db_backend import Backend, Row, is_url, redact
from tenancy.keys import KEY_PREFIX, display_prefix, generate_key, hash_key, keys_match
from tenancy.models import (KEY_ID_PREFIX, TENANT_ID_PREFIX, ApiKeyInfo, AuthResult, Quota, Tenant, UsageGroup,
                            UsageGrouping, UsageRow, validate_tenant_name)
from tenancy.server_secret import ENV_VAR, ServerSecret, load_secret
from tenancy.tiers import DEFAULT_TIER, tier as tier_named

_TENANT_COLUMNS = "id, name, status, weight, created_at, log_text, tier"
_KEY_COLUMNS = "id, tenant_id, label, key_prefix, created_at, expires_at, revoked_at"
_QUOTA_COLUMNS = ("rpm", "tpm", "max_concurrent", "token_budget", "budget_period", "max_tokens_per_request",
                  "max_prompt_tokens", "allowed_models")
_GROUPINGS = ("day", "model", "key", "adapter")


def open_backend(db: str | Path) -> Backend:
    """PostgreSQL for a `postgresql://` URL, else an SQLite file at that path."""
    if is_url(db):
        from tenancy.db_postgres import PostgresBackend  # psycopg only when a URL asks for it

        return PostgresBackend(str(db))
    from tenancy.db_sqlite import SqliteBackend

    return SqliteBackend(db)


class TenancyStore:
    def __init__(self, db: str | Path, pepper: bytes, *, clock: Callable[[], float] = time.time) -> None:
        if not pepper:
            raise ValueError("pepper must be a non-empty server secret")
        self._pepper = pepper
        self._clock = clock
        self._db = open_backend(db)
        self._is = self._db.dialect.is_same
        self.applied_migrations = self._db.applied_migrations

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> TenancyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return self._db.schema_version()

    @property
    def dialect(self) -> str:
        return self._db.dialect.name

    @property
    def backend(self) -> Backend:
        """The open database, for the stores that share it (tenancy/responses_store.py)."""
        return self._db

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return self._db.read(sql, params)

    # --- tenants -------------------------------------------------------------------------------------------

    def create_tenant(self, name: str, weight: float = 1.0, tier: str = DEFAULT_TIER) -> Tenant:
        validate_tenant_name(name)
        if not weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {weight}")
        tenant = Tenant(TENANT_ID_PREFIX + secrets.token_hex(8), name, "active", float(weight), self._clock(),
                        tier=tier_named(tier).name)
        try:
            with self._db.write() as tx:
                tx.execute("INSERT INTO tenants (id, name, status, weight, created_at, tier) VALUES (?, ?, ?, ?, ?, ?)",
                           (tenant.id, tenant.name, tenant.status, tenant.weight, tenant.created_at, tenant.tier))
        except self._db.integrity_errors as exc:
            raise ValueError(f"tenant {name!r} already exists") from exc
        return tenant

    def list_tenants(self) -> list[Tenant]:
        rows = self._read(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")
        return [_tenant(r) for r in rows]

    def find_tenant(self, ref: str) -> Tenant | None:
        rows = self._read(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE id = ? OR name = ?", (ref, ref))
        return _tenant(rows[0]) if rows else None

    def get_tenant(self, ref: str) -> Tenant:
        """By id or name; raises KeyError for an unknown tenant."""
        tenant = self.find_tenant(ref)
        if tenant is None:
            raise KeyError(f"unknown tenant {ref!r}")
        return tenant

    def _set_status(self, ref: str, status: str) -> Tenant:
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("UPDATE tenants SET status = ? WHERE id = ?", (status, tenant_id))
        return self.get_tenant(tenant_id)

    def suspend_tenant(self, ref: str) -> Tenant:
        """Its keys are refused until it is resumed, and its LoRA adapters are unregistered in the same
        transaction (an operator registers them again after a resume): nothing routes to them from then on."""
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("UPDATE tenants SET status = 'suspended' WHERE id = ?", (tenant_id,))
            tx.execute("DELETE FROM lora_adapters WHERE tenant_id = ?", (tenant_id,))
        return self.get_tenant(tenant_id)

    def resume_tenant(self, ref: str) -> Tenant:
        return self._set_status(ref, "active")

    def set_weight(self, ref: str, weight: float) -> Tenant:
        if not weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {weight}")
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("UPDATE tenants SET weight = ? WHERE id = ?", (float(weight), tenant_id))
        return self.get_tenant(tenant_id)

    def set_tier(self, ref: str, tier: str) -> Tenant:
        """The tenant's plan (tenancy/tiers.py): applies to its next requests, within the auth cache's second."""
        name = tier_named(tier).name  # ValueError for an unknown tier, before the store is touched
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("UPDATE tenants SET tier = ? WHERE id = ?", (name, tenant_id))
        return self.get_tenant(tenant_id)

    def set_log_text(self, ref: str, on: bool) -> Tenant:
        """Whether the gateway logs this tenant's prompt and completion text (off by default)."""
        if not isinstance(on, bool):  # a truthy string such as "off" must not switch text logging on
            raise ValueError(f"log_text must be a bool, got {on!r}")
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("UPDATE tenants SET log_text = ? WHERE id = ?", (int(on), tenant_id))
        return self.get_tenant(tenant_id)

    def delete_tenant(self, ref: str) -> None:
        """Removes the tenant, its keys, quotas and LoRA adapters (cascade); its usage rows stay in the ledger."""
        tenant_id = self.get_tenant(ref).id
        with self._db.write() as tx:
            tx.execute("DELETE FROM lora_adapters WHERE tenant_id = ?", (tenant_id,))  # the cascade's, spelt out
            tx.execute("DELETE FROM tenants WHERE id = ?", (tenant_id,))

    # --- keys ----------------------------------------------------------------------------------------------

    def create_key(self, tenant: str, label: str, expires_at: float | None = None) -> tuple[str, str]:
        """Returns (key_id, plaintext). The plaintext is not stored anywhere: show it once."""
        tenant_id = self.get_tenant(tenant).id
        if expires_at is not None and expires_at <= self._clock():
            raise ValueError("expires_at is in the past")
        plaintext = generate_key()
        key_id = KEY_ID_PREFIX + secrets.token_hex(8)
        with self._db.write() as tx:
            tx.execute("INSERT INTO api_keys (id, tenant_id, label, key_hash, key_prefix, created_at, expires_at) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (key_id, tenant_id, label, hash_key(plaintext, self._pepper),
                                                          display_prefix(plaintext), self._clock(), expires_at))
        return key_id, plaintext

    def revoke_key(self, key_id: str) -> bool:
        """True if the key was active and is now revoked; revoking twice keeps the first timestamp."""
        with self._db.write() as tx:
            changed = tx.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                 (self._clock(), key_id)) == 1
            if not changed and not tx.query("SELECT 1 FROM api_keys WHERE id = ?", (key_id,)):
                raise KeyError(f"unknown key {key_id!r}")
        return changed

    def list_keys(self, tenant: str | None = None) -> list[ApiKeyInfo]:
        if tenant is None:
            rows = self._read(f"SELECT {_KEY_COLUMNS} FROM api_keys ORDER BY created_at, id")
        else:
            rows = self._read(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE tenant_id = ? ORDER BY created_at, id",
                              (self.get_tenant(tenant).id,))
        return [ApiKeyInfo(*r) for r in rows]

    def find_key(self, key_id: str) -> ApiKeyInfo | None:
        """The key's displayable record (its tenant_id says who owns it), or None for an unknown id."""
        rows = self._read(f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
        return ApiKeyInfo(*rows[0]) if rows else None

    def authenticate(self, plaintext: str) -> AuthResult | None:
        """None for malformed, unknown, revoked or expired keys. A suspended tenant still authenticates: see
        AuthResult.tenant_status (401 vs 403 is the caller's call)."""
        if not plaintext.startswith(KEY_PREFIX) or len(plaintext) > 256:
            return None
        candidate = hash_key(plaintext, self._pepper)
        # Looking up by hash is safe: equality on a keyed hash leaks nothing about the plaintext.
        rows = self._read("SELECT k.key_hash, k.expires_at, k.revoked_at, t.id, t.name, t.status, k.id, t.weight, "
                          "t.log_text, t.tier FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
                          "WHERE k.key_hash = ?", (candidate,))
        if not rows:
            return None
        stored, expires_at, revoked_at, tenant_id, name, status, key_id, weight, log_text, tier = rows[0]
        if not keys_match(stored, candidate) or revoked_at is not None:
            return None
        if expires_at is not None and self._clock() >= expires_at:
            return None
        return AuthResult(tenant_id, name, status, key_id, weight, bool(log_text), tier)

    # --- quotas --------------------------------------------------------------------------------------------

    def set_quota(self, tenant: str, quota: Quota, key_id: str | None = None) -> None:
        """Replaces the whole quota row of the tenant (key_id None) or of one of its keys."""
        tenant_id = self.get_tenant(tenant).id
        values = [getattr(quota, c) for c in _QUOTA_COLUMNS]
        values[-1] = None if quota.allowed_models is None else json.dumps(list(quota.allowed_models))
        with self._db.write() as tx:
            # The tenant's row lock (PostgreSQL) orders concurrent replacements from several gateways: without
            # it two could both delete, then one insert would hit the unique scope index.
            if not tx.query(f"SELECT 1 FROM tenants WHERE id = ?{self._db.dialect.for_update}", (tenant_id,)):
                raise KeyError(f"unknown tenant {tenant!r}")
            if key_id is not None and not tx.query("SELECT 1 FROM api_keys WHERE id = ? AND tenant_id = ?",
                                                   (key_id, tenant_id)):
                raise KeyError(f"key {key_id!r} does not belong to tenant {tenant!r}")
            tx.execute(f"DELETE FROM quotas WHERE tenant_id = ? AND key_id {self._is} ?", (tenant_id, key_id))
            tx.execute(f"INSERT INTO quotas (tenant_id, key_id, {', '.join(_QUOTA_COLUMNS)}) "
                       f"VALUES (?, ?{', ?' * len(_QUOTA_COLUMNS)})", (tenant_id, key_id, *values))

    def get_quota(self, tenant: str, key_id: str | None = None) -> Quota:
        """The effective quota: the key-level row's non-NULL fields override the tenant-level row's."""
        tenant_id = self.get_tenant(tenant).id
        effective = self._quota_row(tenant_id, None)
        if key_id is not None:
            effective = effective.overridden_by(self._quota_row(tenant_id, key_id))
        return effective

    def quota_rows(self, tenant: str, key_id: str | None = None) -> tuple[Quota, Quota | None]:
        """The tenant-level row and the key's own row (None when the key has none), unmerged: rate, concurrency
        and budget limits count per scope (a tenant's limits cover all its keys; a key's cover that key)."""
        tenant_id = self.get_tenant(tenant).id
        key_row = None
        if key_id is not None and self._read("SELECT 1 FROM quotas WHERE tenant_id = ? AND key_id = ?",
                                             (tenant_id, key_id)):
            key_row = self._quota_row(tenant_id, key_id)
        return self._quota_row(tenant_id, None), key_row

    def _quota_row(self, tenant_id: str, key_id: str | None) -> Quota:
        rows = self._read(f"SELECT {', '.join(_QUOTA_COLUMNS)} FROM quotas WHERE tenant_id = ? AND key_id {self._is} ?",
                          (tenant_id, key_id))
        if not rows:
            return Quota()
        values = dict(zip(_QUOTA_COLUMNS, rows[0]))
        models = values.pop("allowed_models")
        return Quota(**values, allowed_models=None if models is None else tuple(json.loads(models)))

    # --- usage ledger --------------------------------------------------------------------------------------

    def record_usage(self, rows: Sequence[UsageRow]) -> int:
        """Group commit: all rows in one transaction, one fsync. Idempotent on request_id (a retried batch
        neither loses nor doubles a row). Returns how many rows were new."""
        if not rows:
            return 0
        with self._db.write() as tx:
            return tx.execute_many(self._db.dialect.usage_insert(), [usage_params(r) for r in rows])

    def usage_rows(self, tenant: str, since: float | None = None) -> list[UsageRow]:
        tenant_id = self.get_tenant(tenant).id
        rows = self._read("SELECT request_id, tenant_id, key_id, model, prompt_tokens, cached_tokens, "
                          "completion_tokens, status, started_at, finished_at, ttft_ms, latency_ms, adapter FROM usage "
                          "WHERE tenant_id = ? AND started_at >= ? ORDER BY started_at, request_id",
                          (tenant_id, since if since is not None else float("-inf")))
        return [UsageRow(*r) for r in rows]

    def usage_summary(self, tenant: str | None = None, since: float | None = None,
                      by: UsageGrouping | None = None) -> list[UsageGroup]:
        """Totals for one tenant (or all), optionally since a time, optionally grouped by day (UTC), model, key or
        LoRA adapter ('' for the base model)."""
        if by is not None and by not in _GROUPINGS:
            raise ValueError(f"usage grouping must be one of {sorted(_GROUPINGS)}, got {by!r}")
        group = {"day": self._db.dialect.day_of.format("started_at"), "model": "model",
                 "key": "COALESCE(key_id, '')", "adapter": "COALESCE(adapter, '')", None: "''"}[by]
        where = ["started_at >= ?"]
        params: list[float | str] = [since if since is not None else float("-inf")]
        if tenant is not None:
            where.append("tenant_id = ?")
            params.append(self.get_tenant(tenant).id)
        rows = self._read(f"SELECT {group} AS g, COUNT(*), COALESCE(SUM(prompt_tokens), 0), "
                          f"COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(completion_tokens), 0) FROM usage "
                          f"WHERE {' AND '.join(where)} GROUP BY g ORDER BY g", params)
        return [UsageGroup(str(g), n, p, c, o) for g, n, p, c, o in rows if n > 0]

    def tokens_used(self, tenant: str, since: float) -> int:
        """Prompt + completion tokens since a time: seeds the limiter's budget counter at startup."""
        return sum(g.total_tokens for g in self.usage_summary(tenant, since))

    def scope_tokens_used(self, scope: str, since: float) -> int:
        """Prompt + completion tokens a limiter scope ('tenant:<id>' or 'key:<id>') used since a time, from the
        ledger: seeds a budget counter the first time a limiter sees the scope in a period."""
        kind, _, ident = scope.partition(":")
        column = {"tenant": "tenant_id", "key": "key_id"}.get(kind)
        if column is None or not ident:
            raise ValueError(f"unknown limiter scope {scope!r}")
        rows = self._read(f"SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage "
                          f"WHERE {column} = ? AND started_at >= ?", (ident, since))
        return int(rows[0][0])


def usage_params(r: UsageRow) -> tuple[Any, ...]:
    """A ledger row as the parameters of ``Dialect.usage_insert`` (also written by tenancy/batch_store.py)."""
    return (r.request_id, r.tenant_id, r.key_id, r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
            r.status, r.started_at, r.finished_at, r.ttft_ms, r.latency_ms, r.adapter)


def open_store(db_path: str | Path, *, clock: Callable[[], float] = time.time) -> tuple[TenancyStore, ServerSecret]:
    """The store at `db_path` (an SQLite path or a PostgreSQL URL; created and migrated when new) with the
    deployment's server secret. PostgreSQL has no file to put `<db>.secret` beside, and the secret must not live
    in the database it protects: several gateways on one database share KVGATE_SECRET."""
    if is_url(db_path) and not os.environ.get(ENV_VAR):
        raise ValueError(f"a PostgreSQL store ({redact(db_path)}) needs the server secret in {ENV_VAR}")
    secret = load_secret(db_path)
    return TenancyStore(db_path, secret.key_pepper, clock=clock), secret


def _tenant(row: tuple[Any, ...]) -> Tenant:
    return Tenant(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6])
