"""ZeroMQ CURVE for the worker socket: key files, and the socket options of each side.

CURVE (CurveZMQ: Curve25519 key exchange, then every frame encrypted and authenticated) lets a worker on another
host join a gateway over an untrusted network: the worker proves it holds a secret key whose public half the
gateway lists, and checks that it talks to the gateway whose public key it was given. Which worker keys are
accepted is decided by the gateway's ZAP handler (``gateway.fleet.worker_auth``); this module only holds what
both sides need.

Key files are the certificate format of ``zmq.auth`` (czmq's ZPL): ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and the secret key, both Z85 text. Written by ``zmq.auth.create_certificates``
under a 0077 umask, so the secret file is 0600 from its first byte; read by ``zmq.auth.load_certificate``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
from zmq.utils import z85

_log = logging.getLogger(__name__)

ZAP_DOMAIN: Final = "kvgate-workers"  # the gateway's ROUTER asks its ZAP handler about this domain only
Z85_KEY_LEN: Final = 40  # a 32-byte Curve25519 key in Z85
PUBLIC_SUFFIX: Final = ".key"
SECRET_SUFFIX: Final = ".key_secret"
# How the gateway hands its local workers their CURVE keys: the environment, not argv (/proc/PID/cmdline is
# readable by every local user, /proc/PID/environ only by the process's owner).
ENV_SECRET_KEY: Final = "KVGATE_CURVE_SECRET_KEY"
ENV_SERVER_KEY: Final = "KVGATE_CURVE_SERVER_KEY"


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, both halves Z85 (40 ASCII bytes). Its repr never shows the secret half."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for half in (self.public, self.secret):
            check_z85_key(half)

    def __repr__(self) -> str:
        return f"KeyPair(public={self.public.decode()!r}, secret=<hidden>)"

    @staticmethod
    def generate() -> KeyPair:
        public, secret = zmq.curve_keypair()
        return KeyPair(public, secret)

    @staticmethod
    def from_secret(secret: bytes) -> KeyPair:
        check_z85_key(secret)
        return KeyPair(zmq.curve_public(secret), secret)


@dataclass(frozen=True, slots=True)
class ServerCurve:
    """The gateway's side: its own key pair (the ZAP handler decides which clients pass)."""

    keys: KeyPair


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """A worker's side: its key pair and the public key of the gateway it may talk to."""

    keys: KeyPair
    server_public: bytes

    def __post_init__(self) -> None:
        check_z85_key(self.server_public)


def client_curve(key_file: str | None, server_key_file: str | None,
                 environ: MutableMapping[str, str]) -> ClientCurve | None:
    """A worker's CURVE settings: from ``--key`` and ``--server-key`` files, else from the environment the
    gateway gives its local workers (taken out of ``environ`` so nothing the worker starts inherits them), else
    None (plain ZeroMQ)."""
    secret, server = environ.pop(ENV_SECRET_KEY, None), environ.pop(ENV_SERVER_KEY, None)
    if (key_file is None) != (server_key_file is None):
        raise ValueError("--key and --server-key go together: this worker's secret key file and the gateway's "
                         "public key file")
    if key_file is not None and server_key_file is not None:
        return ClientCurve(load_key_pair(Path(key_file)), load_public_key(Path(server_key_file)))
    if secret is not None and server is not None:
        return ClientCurve(KeyPair.from_secret(secret.encode()), server.encode())
    return None


def check_z85_key(key: bytes) -> None:
    if len(key) != Z85_KEY_LEN:
        raise ValueError(f"a CURVE key is {Z85_KEY_LEN} Z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError) as e:
        raise ValueError("a CURVE key must be Z85 text") from e


def apply_server(sock: zmq.Socket[bytes], curve: ServerCurve) -> None:
    """Make ``sock`` (before bind) a CURVE server that asks ZAP about every client; with ZAP_ENFORCE_DOMAIN a
    missing ZAP handler refuses every peer instead of letting them all in."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def apply_client(sock: zmq.Socket[bytes], curve: ClientCurve) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server whose public key ``curve`` names."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)


# --------------------------------------------------------------------------------------------------
# key files
# --------------------------------------------------------------------------------------------------


def create_key_files(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) in ``directory`` (made 0700 if missing).
    Refuses to overwrite either file: a replaced key silently locks out whoever holds the old one."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a key name is a plain file name, got {name!r}")
    public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists():
            raise ValueError(f"{path} exists: refusing to overwrite a key (remove it first to replace it)")
    old = os.umask(0o077)  # the secret file is private from its creation, not after a chmod
    try:
        directory.mkdir(parents=True, exist_ok=True)
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    public.chmod(0o644)  # the public half is meant to be copied around
    return public, secret


def load_key_pair(path: Path) -> KeyPair:
    """The key pair in a secret key file (``NAME.key_secret``). Warns when others can read it."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (give the NAME{SECRET_SUFFIX} file, not NAME{PUBLIC_SUFFIX})")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _log.warning("secret key file %s is readable by others (mode %o): chmod 600 it", path, mode & 0o777)
    pair = KeyPair.from_secret(secret)
    if pair.public != public:
        raise ValueError(f"{path}: its public key does not belong to its secret key")
    return pair


def load_public_key(path: Path) -> bytes:
    """The public key in a key file (either kind)."""
    return _load(path)[0]


def load_public_keys(directory: Path) -> dict[bytes, str]:
    """Every public key in ``directory``'s ``*.key`` files -> the file's name (for logs). A file that is not
    a key file is an error, not a skipped key: a typo must not silently lock a worker out."""
    if not directory.is_dir():
        raise ValueError(f"worker key directory {directory} does not exist or is not a directory")
    keys: dict[bytes, str] = {}
    for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}")):
        keys[load_public_key(path)] = path.stem
    return keys


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ValueError(f"cannot read key file {path}: {e}") from e
    check_z85_key(public)
    if secret is not None:
        check_z85_key(secret)
    return public, secret


# --------------------------------------------------------------------------------------------------
# where a plain (unauthenticated) socket may be bound
# --------------------------------------------------------------------------------------------------


def is_local_endpoint(endpoint: str) -> bool:
    """True when only this host can reach ``endpoint``: ipc:// and inproc://, or tcp:// on a loopback address.
    Anything else (0.0.0.0, *, an interface name, a host name other than localhost) counts as reachable."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
