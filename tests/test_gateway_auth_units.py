"""gateway.api.auth and gateway.base.principal without a server: how a key's own quota combines with its tenant's,
and the per-address bucket for failed authentications (fake clock)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gateway.api.auth import AddressLimiter, Authenticator
from gateway.base.principal import build_principal
from tenancy.limiter import Limiter
from tenancy.models import AuthResult, Quota
from tenancy.server_secret import ServerSecret
from tenancy.store import TenancyStore

AUTH = AuthResult("ten_1", "acme", "active", "key_1", 2.0)


def test_without_a_key_row_only_the_tenant_scope_counts() -> None:
    p = build_principal(AUTH, Quota(rpm=10, max_tokens_per_request=100), None, "salt")
    assert [s.name for s in p.scopes] == ["tenant:ten_1"]
    assert p.quota == Quota(rpm=10, max_tokens_per_request=100) and p.weight == 2.0 and p.cache_salt == "salt"


def test_key_row_adds_its_own_scope_and_overrides_per_request_bounds() -> None:
    tenant = Quota(tpm=1000, max_tokens_per_request=100, allowed_models=("a",))
    key = Quota(tpm=500, max_tokens_per_request=400)  # a key may be granted bigger requests, never more tokens
    p = build_principal(AUTH, tenant, key, "salt")
    assert [s.name for s in p.scopes] == ["tenant:ten_1", "key:key_1"]
    assert p.quota.max_tokens_per_request == 400 and p.quota.tpm == 500 and p.allows_model("a")
    assert not p.allows_model("b")
    limiter = Limiter(lambda: 1_700_000_000.0)
    assert limiter.admit("r1", p.scopes, 10, 300).allowed  # over the tenant's 100, within the key's override
    assert limiter.admit("r2", p.scopes, 10, 401).reason == "never_fits"  # past the key's own bound
    denied = limiter.admit("r3", p.scopes, 10, 300)  # the key's tpm of 500 is spent (the tenant's is not)
    assert denied.reason == "rate_limit_exceeded" and denied.info.limit_tokens == 500


def test_address_limiter_blocks_after_the_budget_and_refills() -> None:
    now = [0.0]
    lim = AddressLimiter(per_minute=3, clock=lambda: now[0])
    for _ in range(3):
        assert lim.blocked_for("1.2.3.4") is None
        lim.record_failure("1.2.3.4")
    wait = lim.blocked_for("1.2.3.4")
    assert wait == pytest.approx(20.0)  # one attempt back every 60 / 3 s
    assert lim.blocked_for("5.6.7.8") is None  # other addresses are not affected
    now[0] += 20.0
    assert lim.blocked_for("1.2.3.4") is None
    with pytest.raises(ValueError):
        AddressLimiter(per_minute=0)


def test_log_text_reaches_the_principal_and_defaults_off() -> None:
    assert build_principal(AUTH, Quota(), None, "salt").log_text is False
    assert build_principal(replace(AUTH, log_text=True), Quota(), None, "salt").log_text is True


@pytest.mark.trio
async def test_log_text_change_applies_once_the_cached_principal_expires(tmp_path: Path) -> None:
    secret = ServerSecret(b"s" * 32)
    now = [0.0]
    with TenancyStore(tmp_path / "kvgate.db", secret.key_pepper) as store:
        store.create_tenant("acme")
        _, key = store.create_key("acme", "k")
        auth = Authenticator(store, secret, ttl=1.0, clock=lambda: now[0])
        header = f"Bearer {key}"
        assert (await auth.authenticate(header, "127.0.0.1")).log_text is False
        store.set_log_text("acme", True)  # as kvgatectl --db would, from another process
        now[0] = 0.5
        assert (await auth.authenticate(header, "127.0.0.1")).log_text is False  # still the cached principal
        now[0] = 1.5
        assert (await auth.authenticate(header, "127.0.0.1")).log_text is True
