"""A private PostgreSQL cluster for tests: `PostgresCluster` and the session fixture `postgres_cluster`, plus
`postgres_url` (a fresh, empty database per test).

The cluster is Debian's PostgreSQL binaries run by hand, never the system service: `initdb` in a temporary
directory, the server on 127.0.0.1 and a free port, its unix socket in that directory, trust authentication for
loopback only, and fsync off (test data need not survive a power cut, and it keeps the suite fast on slow disks).
initdb and postgres refuse to run as root, so as root the cluster runs as the `postgres` system user (created by
Debian's package) through `runuser`. It starts once per test session and is stopped at the end.

Without the binaries (or without a user to run them as) the fixtures skip, unless the environment sets
KVGATE_REQUIRE_POSTGRES=1 (CI), in which case they fail.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import pytest

from tests import ports

START_TIMEOUT_S = 30.0
SUPERUSER = "kvgate"
_dbs = count()


def _fail_or_skip(message: str) -> None:
    if os.environ.get("KVGATE_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " and KVGATE_REQUIRE_POSTGRES=1", pytrace=False)
    pytest.skip(message)


def find_bindir() -> Path | None:
    """Debian's versioned bindir (pg_ctl is not on PATH there), else wherever PATH has initdb."""
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]),
                            reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range (tests/ports.py)


class PostgresCluster:
    def __init__(self, bindir: Path, run_as: str | None) -> None:
        self.bindir = bindir
        self.run_as = run_as
        self.directory = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
        self.data = self.directory / "data"
        self.port = _free_port()

    def _run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        cmd = list(args) if self.run_as is None else ["runuser", "-u", self.run_as, "--", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)

    def start(self) -> None:
        if self.run_as is not None:
            user = pwd.getpwnam(self.run_as)
            os.chown(self.directory, user.pw_uid, user.pw_gid)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                  "--encoding=UTF8", "--no-sync")
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.directory} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.directory / "log"), "-o", options,
                  "-w", "-t", str(int(START_TIMEOUT_S)), "start", timeout=START_TIMEOUT_S + 10)

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass  # never started, or already gone: the directory goes anyway
        shutil.rmtree(self.directory, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh empty database; returns its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(_dbs)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _run_as() -> str | None:
    """None when we may run PostgreSQL ourselves; the system user to run it as when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"],
                       check=True, capture_output=True, timeout=30)
    return "postgres"


def start_cluster() -> PostgresCluster:
    bindir = find_bindir()
    if bindir is None:
        _fail_or_skip("PostgreSQL is not installed (no initdb in /usr/lib/postgresql/*/bin or on PATH)")
        raise AssertionError("unreachable")
    try:
        cluster = PostgresCluster(bindir, _run_as())
    except (subprocess.CalledProcessError, OSError) as e:
        _fail_or_skip(f"no user to run PostgreSQL as: {e}")
        raise AssertionError("unreachable") from None
    try:
        cluster.start()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        log = cluster.directory / "log"
        detail = getattr(e, "stderr", "") or (log.read_text() if log.exists() else "")
        cluster.stop()
        _fail_or_skip(f"the private PostgreSQL cluster did not start: {e}: {detail[-2000:]}")
    return cluster


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    cluster = start_cluster()  # pg_ctl -w: accepting connections when this returns
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    """A fresh, empty database on the session's cluster."""
    return postgres_cluster.create_database()



@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An SQLite file, or a fresh PostgreSQL database's URL: a test of the store runs on both backends."""
    if request.param == "sqlite":
        return str(tmp_path / "kvgate.db")
    return str(request.getfixturevalue("postgres_url"))


def database_at_version(where: str, version: int, inserts: list[str]) -> None:
    """A database (an SQLite path or a PostgreSQL URL) as kvgate left it at schema ``version``: migrations 1 to
    ``version`` applied and recorded, then ``inserts`` run (the rows an upgrade must keep)."""
    from tenancy import schema

    statements = [s for v, batch in schema.MIGRATIONS if v <= version for s in batch]
    if where.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(where) as conn:
            conn.execute(schema.for_postgres(schema.VERSION_TABLE).encode())
            for s in statements:
                conn.execute(schema.for_postgres(s).encode())
            conn.execute(f"INSERT INTO schema_version VALUES ({int(version)}, 0)".encode())
            for s in inserts:
                conn.execute(s.encode())
        return
    import sqlite3

    lite = sqlite3.connect(where)
    lite.execute(schema.VERSION_TABLE)
    for s in statements:
        lite.execute(s)
    lite.execute(f"INSERT INTO schema_version VALUES ({int(version)}, 0)")
    for s in inserts:
        lite.execute(s)
    lite.commit()
    lite.close()
