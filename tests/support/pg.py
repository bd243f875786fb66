"""One throwaway PostgreSQL server per test session, shared by every module that needs one.

`postgres_server` (session fixture, provided by tests/conftest.py) yields a server URL:
`RINGTRAIN_TEST_POSTGRES_URL`, or a server started from the local binaries
(`/usr/lib/postgresql/*/bin/initdb`) on a temp dir and a free port, as a non-root user. Tests never
share a database: each takes its own from `fresh_pg_database`. Import the fixture only in conftest:
a module that imports it gets a fixture (and a server) of its own.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.dist import free_port
from tests.support.require import missing


class Postgres:
    """A throwaway PostgreSQL server from the local binaries, on a temp dir and a free port, run as a
    non-root user (PostgreSQL refuses root); it can be stopped and started again (store outages)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            missing(
                "postgres",
                "PostgreSQL not available: set RINGTRAIN_TEST_POSTGRES_URL or install postgresql "
                "server binaries (apt-get install -y postgresql)",
            )
        self.bin = Path(found[-1]).parent
        self.tmp = Path(tempfile.mkdtemp(prefix="rt-pg-"))
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            user = "postgres" if _user_exists("postgres") else "nobody"
            pw = pwd.getpwnam(user)
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            self.prefix = ["runuser", "-u", user, "--"]
        self.port = free_port()
        self.data = self.tmp / "data"
        self.url = f"postgresql://ringtrain@127.0.0.1:{self.port}/postgres"
        self._initialized = False

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        if not self._initialized:
            self._run(
                "initdb", "-D", str(self.data), "-A", "trust", "-U", "ringtrain", "--no-sync",
                "-E", "UTF8",
            )  # fmt: skip
            self._initialized = True
        options = (
            f"-p {self.port} -k {self.tmp} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c max_connections=100"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.tmp / "log"), "-w", "-t", "60",
            "-o", options, "start",
        )  # fmt: skip

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def started_postgres() -> Postgres:
    """A started server; skipped where PostgreSQL is not installed, a failure where it is installed
    but does not start (a broken environment, not a reason to skip the PostgreSQL half of the suite)."""
    pg = Postgres()
    try:
        pg.start()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        log = (pg.tmp / "log").read_text()[-2000:] if (pg.tmp / "log").exists() else ""
        pg.remove()
        pytest.fail(
            f"PostgreSQL is installed ({pg.bin}) but a throwaway server did not start: {e} "
            f"{getattr(e, 'stderr', b'')!r}\n{log}"
        )
    return pg


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    url = os.environ.get("RINGTRAIN_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    pg = started_postgres()
    try:
        yield pg.url
    finally:
        pg.remove()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def fresh_pg_database(server_url: str) -> str:
    """A new, empty database on the server: one per test."""
    import psycopg

    name = "rt_" + uuid.uuid4().hex[:10]
    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return dsn.rsplit("/", 1)[0] + "/" + name
