"""Engine creation (SQLite in WAL mode, or PostgreSQL via psycopg 3) and the schema's Alembic
upgrades.

Upgrading is an explicit step (`ringtrain db upgrade`, which `serve` and `demo` run before the app
starts); building the app only checks that the schema is current and says how to fix it when not.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import ConnectionPoolEntry

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def normalize_url(url: str) -> str:
    """`postgresql://` → the psycopg 3 driver (the one installed); everything else unchanged."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        u = make_url(url)
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def alembic_config(engine: Engine | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        cfg.set_main_option(
            "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
        )
    return cfg


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent)."""
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def upgrade(url: str) -> str:
    """`ringtrain db upgrade`: the database at `url` brought to the newest revision; returns it."""
    engine = make_engine(url)
    try:
        migrate(engine)
        return current_revision(engine) or ""
    finally:
        engine.dispose()


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the migrations folder has no revision"
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


class SchemaOutdated(RuntimeError):
    """The database is not at the newest revision: the app would fail on its first query."""


def require_current(engine: Engine) -> None:
    """Raise SchemaOutdated, naming the command that fixes it, unless the schema is at the head."""
    have, want = current_revision(engine), head_revision()
    if have != want:
        where = engine.url.render_as_string(hide_password=True)
        raise SchemaOutdated(
            f"the database {where} is at schema revision {have or '(none)'}, not {want}: "
            f"run `ringtrain db upgrade --database-url ...` first"
        )
