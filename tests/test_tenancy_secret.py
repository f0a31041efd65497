"""tenancy.server_secret: one secret per deployment, from the environment or a 0600 file beside the store."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tenancy.server_secret import ENV_VAR, ServerSecret, load_secret, secret_path
from tenancy.store import open_store


def test_file_secret_is_created_once_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    db = tmp_path / "kvgate.db"
    with ThreadPoolExecutor(8) as pool:  # concurrent first starts agree on one secret
        secrets = list(pool.map(lambda _: load_secret(db), range(16)))
    assert len({s.value for s in secrets}) == 1 and len(secrets[0].value) == 32
    assert stat.S_IMODE(os.stat(secret_path(db)).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvgate.db.secret"]  # no temp file left behind
    assert load_secret(db).value == secrets[0].value


def test_env_secret_wins_and_short_ones_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "x" * 40)
    assert load_secret(tmp_path / "a.db").value == b"x" * 40
    assert not secret_path(tmp_path / "a.db").exists()
    monkeypatch.setenv(ENV_VAR, "short")
    with pytest.raises(ValueError, match="at least"):
        load_secret(tmp_path / "a.db")


def test_missing_secret_without_create_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="no server secret"):
        load_secret(tmp_path / "a.db", create=False)


def test_derived_values_are_separate_and_tenant_salts_unguessable() -> None:
    a, b = ServerSecret(b"a" * 32), ServerSecret(b"b" * 32)
    assert a.key_pepper != b.key_pepper and a.key_pepper != a.value
    assert a.cache_salt("ten_1") != b.cache_salt("ten_1")  # another deployment's salts differ
    assert a.cache_salt("ten_1") != a.cache_salt("ten_2") and a.cache_salt("ten_1") == a.cache_salt("ten_1")
    assert "ten_1" not in a.cache_salt("ten_1")


def test_keys_made_by_one_opener_authenticate_in_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    store, _ = open_store(tmp_path / "kvgate.db")
    store.create_tenant("acme")
    _, plaintext = store.create_key("acme", "ci")
    store.close()
    again, _ = open_store(tmp_path / "kvgate.db")  # e.g. kvgatectl made the key, the gateway checks it
    auth = again.authenticate(plaintext)
    assert auth is not None and auth.tenant_name == "acme"
    again.close()
