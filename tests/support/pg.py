"""One throwaway PostgreSQL server per test session, shared by every module that needs one.

`postgres_server` (session fixture, provided by tests/conftest.py) yields a server URL:
`RINGTRAIN_TEST_POSTGRES_URL`, or a server started from the local binaries
(`/usr/lib/postgresql/*/bin/initdb`) on a temp dir and a free port, as a non-root user. Tests never
share a database: each takes its own from `fresh_pg_database`. Import the fixture only in conftest:
a module that imports it gets a fixture (and a server) of its own.
"""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    url = os.environ.get("RINGTRAIN_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.skip(
            "PostgreSQL not available: set RINGTRAIN_TEST_POSTGRES_URL or install postgresql server binaries"
        )
    bindir = Path(found[-1]).parent
    tmp = Path(tempfile.mkdtemp(prefix="rt-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        user = "postgres" if _user_exists("postgres") else "nobody"
        pw = pwd.getpwnam(user)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
        prefix = ["runuser", "-u", user, "--"]
    port = free_port()
    data = tmp / "data"
    try:
        subprocess.run(
            [
                *prefix,
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-A",
                "trust",
                "-U",
                "ringtrain",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [
                *prefix,
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(tmp / "log"),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        log = (tmp / "log").read_text() if (tmp / "log").exists() else ""
        shutil.rmtree(tmp, ignore_errors=True)
        # installed but not starting is a broken environment, not a reason to skip the PostgreSQL half of the suite
        pytest.fail(
            f"PostgreSQL is installed ({bindir}) but a throwaway server did not start: {e} "
            f"{getattr(e, 'stderr', b'')!r} {log[-500:]}"
        )
    try:
        yield f"postgresql://ringtrain@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(tmp, ignore_errors=True)


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
