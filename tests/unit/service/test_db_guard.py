"""`service.db` connection building, in process and without a PostgreSQL server.

`postgres://` and `postgresql://` URLs get the installed psycopg 3 driver; the client's libpq
parameters go into the URL unless the URL names them itself (the URL wins), its startup options go
first and the URL's own after them (PostgreSQL applies the last `-c` of a name), and no statement is
prepared server-side; the LISTEN DSN carries the same settings and nothing psycopg.connect-only; a
password with `%` survives Alembic's config interpolation; the pool is sized from the client;
SQLite files get their folder made and the pragmas (WAL, foreign keys, busy timeout) on every
connection. A schema at a revision this release does not know is run on only when the window
recorded for that very revision allows it (a stale record for another revision does not), and
recording the window on a database at no revision leaves no row. Nothing here opens a PostgreSQL
connection: engines connect lazily.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import event, text
from sqlalchemy.engine import make_url

from service.db import (
    SCHEMA_COMPAT,
    SchemaTooNew,
    alembic_config,
    head_revision,
    listen_dsn,
    make_engine,
    migrate,
    normalize_url,
    postgres_connection,
    record_compatibility,
    schema_state,
)
from service.settings import DatabaseClient
from tests.support.pg import fresh_pg_database

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
CLIENT_OPTIONS = (
    "-c lock_timeout=1500ms -c idle_in_transaction_session_timeout=3000ms "
    "-c tcp_keepalives_idle=7 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=5"
)


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("postgres://u:pw@db:5432/rt", "postgresql+psycopg://u:pw@db:5432/rt"),
        ("postgresql://u:pw@db/rt", "postgresql+psycopg://u:pw@db/rt"),
        ("postgresql+psycopg://u@db/rt", "postgresql+psycopg://u@db/rt"),
        ("sqlite:///./ringtrain.db", "sqlite:///./ringtrain.db"),
    ],
)
def test_normalize_url_picks_psycopg_for_both_postgres_schemes(given: str, normal: str) -> None:
    assert normalize_url(given) == normal


def test_the_urls_own_parameters_win_and_its_options_come_last() -> None:
    url = "postgresql://u:pw@db/rt?connect_timeout=30&options=-c%20lock_timeout%3D9s"
    u, connect_args = postgres_connection(url, CLIENT)
    assert u.drivername == "postgresql+psycopg"
    assert dict(u.query) == {
        "connect_timeout": "30",  # the URL's, not the client's 4
        "keepalives": "1",
        "keepalives_idle": "7",
        "keepalives_interval": "2",
        "keepalives_count": "5",
    }
    assert connect_args == {
        "prepare_threshold": None,
        "options": CLIENT_OPTIONS + " -c lock_timeout=9s",
    }
    u, connect_args = postgres_connection(
        "postgresql://u@db/rt", DatabaseClient(session_options=False)
    )
    assert connect_args == {"prepare_threshold": None}  # no empty `options`
    assert dict(u.query)["keepalives_idle"] == "30"


def test_the_listen_dsn_carries_the_same_settings() -> None:
    got = conninfo_to_dict(listen_dsn("postgres://u:p%40ss@db:6543/rt", CLIENT))
    assert got == {
        "user": "u",
        "password": "p@ss",
        "host": "db",
        "port": "6543",
        "dbname": "rt",
        "connect_timeout": "4",
        "keepalives": "1",
        "keepalives_idle": "7",
        "keepalives_interval": "2",
        "keepalives_count": "5",
        "options": CLIENT_OPTIONS,
    }


def test_a_postgres_engine_is_sized_by_the_client_and_alembic_keeps_a_percent_password() -> None:
    engine = make_engine("postgresql://u:p%25w@db/rt", CLIENT)
    try:
        assert (engine.pool.size(), engine.pool._max_overflow) == (3, 4)  # type: ignore[attr-defined]
        rendered = alembic_config(engine).get_main_option("sqlalchemy.url")
        assert rendered is not None and make_url(rendered).password == "p%w"
    finally:
        engine.dispose()


def test_a_sqlite_file_gets_its_folder_and_pragmas(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "rt.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as c:
            got = {
                p: c.execute(text(f"PRAGMA {p}")).scalar_one()
                for p in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
            }
        assert got == {
            "journal_mode": "wal",
            "synchronous": 1,
            "foreign_keys": 1,
            "busy_timeout": 30000,
        }
        assert path.is_file()
    finally:
        engine.dispose()


def test_a_newer_schema_runs_only_within_the_window_recorded_for_it(tmp_path: Path) -> None:
    """The schema at `future` (not among this release's revisions): a record for `future` naming
    this release's head as compatible_since is the window; the same record for `other` is stale."""
    engine = make_engine(f"sqlite:///{tmp_path}/rt.db")
    try:
        migrate(engine)
        ours = head_revision()
        with engine.begin() as c:
            c.execute(text("UPDATE alembic_version SET version_num = 'future'"))
            c.execute(
                text("UPDATE schema_compat SET revision = 'future', compatible_since = :h"),
                {"h": ours},
            )
        with engine.connect() as c:
            assert schema_state(c) == "ahead"
        with engine.begin() as c:
            c.execute(text("UPDATE schema_compat SET revision = 'other'"))
        with engine.connect() as c, pytest.raises(SchemaTooNew, match="records no older release"):
            schema_state(c)
    finally:
        engine.dispose()


def test_recording_the_window_at_no_revision_leaves_no_row(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/rt.db")
    try:
        with engine.begin() as c:
            SCHEMA_COMPAT.create(c)
            c.execute(
                SCHEMA_COMPAT.insert().values(
                    id=1, revision="old", compatible_since="old", written_by="0.1", written_at=1.0
                )
            )
            record_compatibility(c, ScriptDirectory.from_config(alembic_config()))
            assert c.execute(text("SELECT count(*) FROM schema_compat")).scalar_one() == 0
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_an_upgrade_waits_for_locks_as_long_as_it_is_told(postgres_server: str) -> None:
    """Both SET LOCAL lock_timeout statements of a PostgreSQL upgrade, in milliseconds: the
    migration lock's wait, then each DDL statement's."""
    engine = make_engine(fresh_pg_database(postgres_server))
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def record(*args: object) -> None:
        statement = str(args[2])
        if statement.startswith("SET LOCAL lock_timeout"):
            seen.append(statement)

    try:
        migrate(engine, lock_wait_s=2.5, ddl_lock_timeout_s=1.25)
        assert seen == ["SET LOCAL lock_timeout = '2500ms'", "SET LOCAL lock_timeout = '1250ms'"]
    finally:
        engine.dispose()
