"""Engine creation (SQLite in WAL mode, or PostgreSQL via psycopg 3) and the schema's Alembic
upgrades.

Upgrading is an explicit step (`ringtrain db upgrade`, which `serve` and `demo` run before the app
starts); building the app only checks that the schema is current and says how to fix it when not.

PostgreSQL connections carry the client settings of `service.settings.DatabaseClient`: a connect
timeout and TCP keepalives (libpq parameters, in the engine's URL, so a DSN rendered from it has
them too), the session's lock and idle-in-transaction timeouts and the server's keepalives (the
`options` startup parameter), and no server-side prepared statements (`prepare_threshold=None`:
PgBouncer in transaction mode hands each transaction to any server connection, where a statement
prepared on another one does not exist). Replicas and init containers may upgrade at once: an
upgrade holds a transaction-level advisory lock, and its DDL waits for table locks only briefly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import ConnectionPoolEntry

from service.settings import DatabaseClient
from service.store.errors import lock_wait_over

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key of schema upgrades: "ringtrai" in ASCII
MIGRATION_LOCK = 0x72696E6774726169
MIGRATION_LOCK_WAIT_S = 300.0  # another replica's upgrade of a large table may take this long
MIGRATION_DDL_LOCK_TIMEOUT_S = 10.0  # a DDL statement waits this long for its table, then fails


def normalize_url(url: str) -> str:
    """`postgresql://` → the psycopg 3 driver (the one installed); everything else unchanged."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_engine(url: str, client: DatabaseClient | None = None) -> Engine:
    """An engine on `url`; on PostgreSQL with `client`'s settings (default: from RINGTRAIN_DB_*).
    Parameters already in the URL's query win over the client's."""
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
    client = client or DatabaseClient()
    u, connect_args = postgres_connection(url, client)
    return create_engine(
        u,
        pool_pre_ping=True,
        pool_size=client.pool_size,
        max_overflow=client.max_overflow,
        connect_args=connect_args,
    )


def postgres_connection(url: str, client: DatabaseClient) -> tuple[URL, dict[str, Any]]:
    """The URL with the client's libpq parameters (those the URL names itself win) and the
    keyword arguments for psycopg.connect: `options` (the URL's own after the client's, so
    theirs win) and `prepare_threshold`. `options` is kept out of the URL: a DSN rendered from it
    would keep its spaces as "+", which libpq does not decode."""
    u = make_url(normalize_url(url))
    own = u.query.get("options")
    theirs = (own,) if isinstance(own, str) else tuple(own or ())
    options = " ".join(o for o in (client.server_options(), *theirs) if o)
    query = {k: v for k, v in client.libpq_params().items() if k not in u.query}
    u = u.difference_update_query(["options"]).update_query_dict(query)
    connect_args: dict[str, Any] = {"prepare_threshold": None}
    if options:
        connect_args["options"] = options
    return u, connect_args


def listen_dsn(url: str, client: DatabaseClient | None = None) -> str:
    """A libpq conninfo string with the same client settings as `make_engine`'s pool, for plain
    psycopg connections (the event relay's LISTEN and NOTIFY)."""
    from psycopg.conninfo import make_conninfo

    u, connect_args = postgres_connection(url, client or DatabaseClient())
    dsn = u.set(drivername="postgresql").render_as_string(hide_password=False)
    return make_conninfo(dsn, **{k: v for k, v in connect_args.items() if k == "options"})


def alembic_config(engine: Engine | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        cfg.set_main_option(
            "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
        )
    return cfg


class MigrationLocked(RuntimeError):
    """Another upgrade held the migration lock longer than this one would wait."""


def migrate(
    engine: Engine,
    *,
    lock_wait_s: float = MIGRATION_LOCK_WAIT_S,
    ddl_lock_timeout_s: float = MIGRATION_DDL_LOCK_TIMEOUT_S,
) -> None:
    """Bring the schema to the newest revision (idempotent), in one transaction. On PostgreSQL it
    first takes the migration lock (waiting up to `lock_wait_s` for another upgrade, which then
    leaves nothing to do), and each DDL statement waits at most `ddl_lock_timeout_s` for its table:
    an upgrade that cannot get a table fails instead of queueing every query behind it."""
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            take_migration_lock(conn, lock_wait_s)
            conn.execute(text(f"SET LOCAL lock_timeout = '{round(ddl_lock_timeout_s * 1000)}ms'"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def take_migration_lock(conn: Connection, wait_s: float) -> None:
    """The transaction-level advisory lock of schema upgrades (released at commit or rollback)."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{round(wait_s * 1000)}ms'"))
    try:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
    except DBAPIError as e:
        if not lock_wait_over(e):
            raise
        raise MigrationLocked(
            f"another schema upgrade held the migration lock for over {wait_s:g} s; "
            "run `ringtrain db upgrade` again once it ends"
        ) from e


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
