"""The deployment's one server secret and the keys derived from it.

Every gateway of a deployment and `kvgatectl --db` must agree on it: API keys are stored as HMACs keyed by a
pepper derived from it, and tenants' cache salts are HMACs keyed by another derived key. It comes from
`KVGATE_SECRET` when set (several hosts: give them all the same value), else from a file beside the database
(`<db>.secret`, created with mode 0600 on first use), so a stolen database file alone cannot confirm a guessed
key or a tenant's cache salt. Losing the secret invalidates every API key: back the file up with the database.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "KVGATE_SECRET"
SECRET_BYTES = 32
_MIN_ENV_CHARS = 16  # a short env secret is a configuration mistake, not a secret


@dataclass(frozen=True)
class ServerSecret:
    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < _MIN_ENV_CHARS:
            raise ValueError(f"the server secret must be at least {_MIN_ENV_CHARS} bytes")

    def _derive(self, purpose: str) -> bytes:
        # Domain separation: the pepper and the salt key are independent, and neither is the secret itself.
        return hmac.new(self.value, f"kvgate/{purpose}/v1".encode(), hashlib.sha256).digest()

    @property
    def key_pepper(self) -> bytes:
        return self._derive("api-key-pepper")

    def cache_salt(self, tenant_id: str) -> str:
        """Opaque per-tenant prefix-cache salt: stable across gateways, unguessable from the tenant's name or id."""
        return hmac.new(self._derive("cache-salt"), tenant_id.encode(), hashlib.sha256).hexdigest()[:32]


def secret_path(db_path: str | Path) -> Path:
    return Path(f"{db_path}.secret")


def load_secret(db_path: str | Path, *, create: bool = True) -> ServerSecret:
    """`KVGATE_SECRET`, else `<db>.secret` (created when missing and `create`); raises ValueError otherwise."""
    env = os.environ.get(ENV_VAR)
    if env:
        if len(env) < _MIN_ENV_CHARS:
            raise ValueError(f"{ENV_VAR} must be at least {_MIN_ENV_CHARS} characters")
        return ServerSecret(env.encode())
    path = secret_path(db_path)
    if not path.exists():
        if not create:
            raise ValueError(f"no server secret: set {ENV_VAR} or create the store first ({path} is missing)")
        _create(path)
    text = path.read_text(encoding="ascii").strip()
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path} does not hold a hex secret") from None
    return ServerSecret(value)


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        # link() is atomic and refuses to replace: of two processes starting on a fresh store, exactly one
        # secret wins, and nobody ever reads a half-written file.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
