"""PostgreSQL client settings on a real server (`service.settings.DatabaseClient`, `service.db`): the
timeouts, keepalives and pool sizes are in effect on the app's engine and on the LISTEN connection,
no statement is ever prepared server-side (PgBouncer in transaction mode), the lease row is waited
for only briefly, a follower takes the lease over within the lease when the leader's connection
died inside a transaction, and concurrent schema upgrades take turns under the migration lock."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from api.app import create_app
from service.db import (
    MIGRATION_LOCK,
    MigrationLocked,
    current_revision,
    head_revision,
    listen_dsn,
    make_engine,
    migrate,
)
from service.leader import Leadership
from service.settings import DatabaseClient, Settings
from service.store import LeaseBusy, Store
from tests.support.api_harness import TOKENS, RecordingLauncher
from tests.support.pg import fresh_pg_database

pytestmark = pytest.mark.postgres

CLIENT = DatabaseClient(
    pool_size=3,
    max_overflow=4,
    connect_timeout_s=4,
    keepalives_idle_s=7,
    keepalives_interval_s=2,
    keepalives_count=5,
    lock_timeout_s=1.5,
    idle_in_transaction_timeout_s=3.0,
)
SHOWN = {
    "lock_timeout": "1500ms",
    "idle_in_transaction_session_timeout": "3s",
    "tcp_keepalives_idle": "7",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "5",
}


@pytest.fixture
def url(postgres_server: str) -> str:
    return fresh_pg_database(postgres_server)


@pytest.fixture
def engine(url: str) -> Iterator[Engine]:
    e = make_engine(url, CLIENT)
    migrate(e)
    yield e
    e.dispose()


def shown(conn: psycopg.Connection) -> dict[str, str]:
    return {k: str(conn.execute(f"SHOW {k}").fetchone()[0]) for k in SHOWN}


def socket_keepalive(fd: int) -> tuple[int, int, int, int]:
    s = socket.socket(fileno=os.dup(fd))
    try:
        return (
            s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        )
    finally:
        s.close()


def test_the_settings_are_in_effect_on_the_pool_and_the_listen_connection(
    engine: Engine, url: str
) -> None:
    with engine.connect() as c:
        raw = c.connection.dbapi_connection
        assert isinstance(raw, psycopg.Connection)
        assert shown(raw) == SHOWN
        assert socket_keepalive(raw.pgconn.socket) == (1, 7, 2, 5)
        assert raw.info.get_parameters()["connect_timeout"] == "4"
        # run one parameterised statement well past psycopg's default threshold (5): nothing prepared
        for i in range(12):
            c.execute(text("SELECT count(*) FROM jobs WHERE owner = :o"), {"o": f"x{i}"})
        assert c.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar_one() == 0
        assert raw.prepare_threshold is None
    assert (engine.pool.size(), engine.pool._max_overflow) == (3, 4)

    with psycopg.connect(listen_dsn(url, CLIENT), autocommit=True) as listen:
        assert shown(listen) == SHOWN
        assert socket_keepalive(listen.pgconn.socket) == (1, 7, 2, 5)
        listen.execute("LISTEN ringtrain_events")
    # a DSN rendered from the engine's URL (how api.app builds the relay's) keeps the libpq part
    rendered = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(rendered, autocommit=True, connect_timeout=5) as relay:
        assert socket_keepalive(relay.pgconn.socket) == (1, 7, 2, 5)
        assert relay.execute("SHOW lock_timeout").fetchone() == ("0",)  # options: listen_dsn only


def test_the_apps_engine_takes_them_from_the_environment(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`create_app` builds its engine from the URL alone: RINGTRAIN_DB_* still reach it."""
    migrate_engine = make_engine(url)
    migrate(migrate_engine)
    migrate_engine.dispose()
    monkeypatch.setenv("RINGTRAIN_DB_LOCK_TIMEOUT_S", "2.5")
    monkeypatch.setenv("RINGTRAIN_DB_POOL_SIZE", "4")
    settings = Settings(database_url=url, api_tokens=TOKENS, token_file=tmp_path / "token")
    assert (settings.db.lock_timeout_s, settings.db.pool_size) == (2.5, 4)
    app = create_app(settings, RecordingLauncher())
    engine = app.state.ctx.store.db.engine
    try:
        with engine.connect() as c:
            got = {
                k: c.execute(text(f"SHOW {k}")).scalar_one()
                for k in ("lock_timeout", "idle_in_transaction_session_timeout")
            }
        # the one set, and a default
        assert got == {"lock_timeout": "2500ms", "idle_in_transaction_session_timeout": "10s"}
        assert engine.pool.size() == 4
    finally:
        engine.dispose()


def hold_lease_row(engine: Engine) -> Connection:
    """A transaction that locks the lease row as a renewal does, then goes silent (its client died)."""
    conn = engine.connect()
    conn.begin()
    conn.execute(text("SELECT holder FROM leases WHERE name = 'controller' FOR UPDATE"))
    return conn


def test_acquiring_a_locked_lease_row_gives_up_after_the_wait(url: str) -> None:
    patient = make_engine(url, DatabaseClient(idle_in_transaction_timeout_s=600))
    migrate(patient)
    store = Store(
        make_engine(url, CLIENT.model_copy(update={"lock_timeout_s": 10.0}))
    )  # the bound is the call's
    held = hold_lease_row(patient)
    try:
        t0 = time.monotonic()
        with pytest.raises(LeaseBusy, match="not this round"):
            store.leases.acquire("b", 5.0, lock_wait_s=0.3)
        took = time.monotonic() - t0
        assert 0.3 <= took < 2.0, took
    finally:
        held.close()
    assert store.leases.acquire("b", 5.0, lock_wait_s=0.3).holder == "b"
    store.db.engine.dispose()
    patient.dispose()


def test_a_follower_takes_over_when_the_leader_died_inside_a_transaction(url: str) -> None:
    """The leader renews, then its next renewal locks the row and its node dies: no packet ever
    comes again. PostgreSQL ends that session after the idle-in-transaction timeout (1.5 s), which
    frees the row; the follower, waiting for it only briefly each round, takes over once the lease
    runs out (3 s after the last renewal), not hours later when TCP would notice."""
    lease_s = 3.0
    client = CLIENT.model_copy(update={"idle_in_transaction_timeout_s": 1.5})
    engine_a, engine_b = make_engine(url, client), make_engine(url, client)
    migrate(engine_a)
    store_a, store_b = Store(engine_a), Store(engine_b)
    assert store_a.leases.acquire("a", lease_s).holder == "a"
    renewed = time.monotonic()
    dead = hold_lease_row(engine_a)

    async def follower() -> tuple[bool, float, int]:
        elected: list[float] = []

        async def deposed() -> None:
            return None

        b = Leadership(
            store_b,
            lease_s=lease_s,
            on_elected=lambda *_: elected.append(time.monotonic()),
            on_deposed=deposed,
        )
        b.replica = "b"
        await b.start()
        ok = await b.wait_elected(lease_s + 10)
        epoch = b.snapshot().epoch
        await b.stop()
        return ok, elected[0] if elected else float("inf"), epoch

    ok, at, epoch = asyncio.run(follower())
    print(
        f"\n[lease] follower took over {at - renewed:.2f}s after the dead leader's last renewal (lease {lease_s:g}s)"
    )
    assert ok and epoch == 2
    assert at - renewed <= lease_s + 1.5, at - renewed
    with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
        dead.execute(text("SELECT 1"))
    dead.close()
    engine_a.dispose()
    engine_b.dispose()


def test_concurrent_upgrades_take_turns_under_the_migration_lock(url: str) -> None:
    """Three `ringtrain db upgrade` processes (init containers of a rollout) on one empty database
    at once: all succeed, one does the work; an upgrade that waits too long says so."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"from service.db import upgrade; print(upgrade({url!r}))"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    got = [(p.returncode, out.strip()) for p, (out, _) in zip(procs, outs, strict=True)]
    assert got == [(0, head_revision())] * 3, outs
    engine = make_engine(url, CLIENT)
    assert current_revision(engine) == head_revision()

    with psycopg.connect(url, autocommit=True) as other:  # an upgrade that does not end
        other.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        t0 = time.monotonic()
        with pytest.raises(MigrationLocked, match="another schema upgrade"):
            migrate(engine, lock_wait_s=0.5)
        assert time.monotonic() - t0 < 3.0
    migrate(engine, lock_wait_s=0.5)  # its session ended: the lock is free again
    engine.dispose()
