"""Engine creation (SQLite in WAL mode, or PostgreSQL via psycopg 3) and the schema's Alembic
upgrades.

Upgrading is an explicit step (`ringtrain db upgrade`, which `serve` and `demo` run before the app
starts); building the app only checks that this release can run on the schema and says how to fix
it when not. A schema newer than this release is accepted within the window its last upgrade
recorded (`schema_compat`; expand-then-contract, see service/migrations/env.py): a rollback starts,
and its upgrade step changes nothing.

PostgreSQL connections carry the client settings of `service.settings.DatabaseClient`: a connect
timeout and TCP keepalives (libpq parameters, in the engine's URL, so a DSN rendered from it has
them too), the session's lock and idle-in-transaction timeouts and the server's keepalives (the
`options` startup parameter), and no server-side prepared statements (`prepare_threshold=None`:
PgBouncer in transaction mode hands each transaction to any server connection, where a statement
prepared on another one does not exist). Replicas and init containers may upgrade at once: an
upgrade holds a transaction-level advisory lock, and its DDL waits for table locks only briefly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Float,
    Integer,
    String,
    Table,
    create_engine,
    delete,
    event,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import ConnectionPoolEntry

from service.models import Base
from service.settings import DatabaseClient
from service.store.errors import lock_wait_over

log = logging.getLogger("ringtrain.db")
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


def alembic_config(engine: Engine | None = None, migrations: Path = MIGRATIONS) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations))
    if engine is not None:
        cfg.set_main_option(
            "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
        )
    return cfg


class MigrationLocked(RuntimeError):
    """An upgrade waited longer than it would for a lock: another upgrade's, or a table's."""


def migrate(
    engine: Engine,
    *,
    lock_wait_s: float = MIGRATION_LOCK_WAIT_S,
    ddl_lock_timeout_s: float = MIGRATION_DDL_LOCK_TIMEOUT_S,
    migrations: Path = MIGRATIONS,
) -> None:
    """Bring the schema to the newest revision of `migrations` (idempotent), in one transaction;
    leave a newer one this release can run on as it is (SchemaTooNew beyond that window). On
    PostgreSQL it first takes the migration lock (waiting up to `lock_wait_s` for another upgrade,
    which then leaves nothing to do), and each DDL statement waits at most `ddl_lock_timeout_s`
    for its table: an upgrade that cannot get one fails instead of queueing every query behind
    it."""
    cfg = alembic_config(engine, migrations)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            take_migration_lock(conn, lock_wait_s)
            conn.execute(text(f"SET LOCAL lock_timeout = '{round(ddl_lock_timeout_s * 1000)}ms'"))
        if schema_state(conn, migrations) == "ahead":  # a newer release upgraded it
            log.warning("the database schema is newer than this release's: not upgrading it")
            return
        cfg.attributes["connection"] = conn
        try:
            command.upgrade(cfg, "head")
        except DBAPIError as e:
            if not lock_wait_over(e):
                raise
            raise MigrationLocked(
                f"a table the upgrade changes stayed locked for over {ddl_lock_timeout_s:g} s "
                "(a long transaction on it); nothing was changed: run `ringtrain db upgrade` "
                "again once it ends"
            ) from e


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
    """`ringtrain db upgrade`: the database at `url` brought to the newest revision; returns the
    revision it is at (a newer one than this release's head when it was ahead, within the
    window)."""
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


# ---- compatibility with newer schemas (the rules: service/migrations/env.py) -------------------
SCHEMA_COMPAT = Table(  # made by migration 0006; only ever grows (older releases read it)
    "schema_compat",
    Base.metadata,
    Column("id", Integer, primary_key=True),
    Column("revision", String(64), nullable=False),
    Column("compatible_since", String(64), nullable=False),
    Column("written_by", String(64), nullable=False),
    Column("written_at", Float, nullable=False),
)


@dataclass(frozen=True)
class Compatibility:
    """What the last upgrade recorded: the schema's revision, the oldest revision whose code runs
    on it, and the ringtrain release that wrote it."""

    revision: str
    compatible_since: str
    written_by: str


def release() -> str:
    """This ringtrain's version (what `schema_compat.written_by` records)."""
    try:
        return version("ringtrain")
    except PackageNotFoundError:
        return "unknown"


def compatible_since(script: ScriptDirectory, revision: str) -> str:
    """The `compatible_since` a migration declares (every migration declares one)."""
    found = script.get_revision(revision)
    since = getattr(found.module, "compatible_since", None) if found is not None else None
    if not isinstance(since, str):
        raise RuntimeError(
            f"migration {revision} declares no compatible_since (see service/migrations/env.py)"
        )
    return since


def record_compatibility(conn: Connection, script: ScriptDirectory) -> None:
    """Store the current revision's compatibility in `schema_compat` (once that table exists):
    run by service/migrations/env.py after every migration run, in its transaction."""
    if not inspect(conn).has_table(SCHEMA_COMPAT.name):
        return
    revision = MigrationContext.configure(conn).get_current_revision()
    conn.execute(delete(SCHEMA_COMPAT))
    if revision is None:
        return
    since = compatible_since(script, revision)
    row = dict(revision=revision, compatible_since=since, written_by=release())
    conn.execute(insert(SCHEMA_COMPAT).values(id=1, written_at=time.time(), **row))


def recorded_compatibility(conn: Connection) -> Compatibility | None:
    if not inspect(conn).has_table(SCHEMA_COMPAT.name):
        return None
    c = SCHEMA_COMPAT.c
    q = select(c.revision, c.compatible_since, c.written_by).where(c.id == 1)
    row = conn.execute(q).first()
    return None if row is None else Compatibility(row[0], row[1], row[2])


class SchemaOutdated(RuntimeError):
    """The database is not at the newest revision: the app would fail on its first query."""


class SchemaTooNew(RuntimeError):
    """The database is at a revision newer than this release, outside the window in which this
    release still runs on it."""


SchemaState = Literal["current", "behind", "ahead"]


def schema_state(conn: Connection, migrations: Path = MIGRATIONS) -> SchemaState:
    """Where the database's schema stands for the release with `migrations`: at its head, behind
    it (an upgrade brings it there), or ahead of it within the recorded window (this release runs
    on it as it is). Raises SchemaTooNew, naming the release needed, when it is ahead beyond the
    window."""
    script = ScriptDirectory.from_config(alembic_config(migrations=migrations))
    have = MigrationContext.configure(conn).get_current_revision()
    head = script.get_current_head()
    if have == head:
        return "current"
    known = {s.revision for s in script.walk_revisions()}
    if have is None or have in known:
        return "behind"
    compat = recorded_compatibility(conn)
    if compat is not None and compat.revision == have and compat.compatible_since in known:
        return "ahead"
    where = conn.engine.url.render_as_string(hide_password=True)
    this = f"this release (ringtrain {release()}) has schema revisions up to {head} only"
    if compat is None or compat.revision != have:
        raise SchemaTooNew(
            f"the database {where} is at schema revision {have}, newer than this release knows, "
            f"and records no older release that can run on it; {this}: run the release that "
            "upgraded it, or a newer one"
        )
    raise SchemaTooNew(
        f"the database {where} is at schema revision {have}, written by ringtrain "
        f"{compat.written_by}, which releases from schema revision {compat.compatible_since} on "
        f"can run on; {this}: run ringtrain {compat.written_by} (or a release whose migrations "
        f"include {compat.compatible_since})"
    )


def require_current(engine: Engine) -> None:
    """Raise unless this release can run on the schema: SchemaOutdated, naming the command that
    fixes it, when the schema is behind; SchemaTooNew when it is ahead beyond the window. A newer
    schema within the window is accepted (a rollback, or an old replica during a rollout)."""
    with engine.connect() as conn:
        state = schema_state(conn)
        have = MigrationContext.configure(conn).get_current_revision()
    if state == "behind":
        where = engine.url.render_as_string(hide_password=True)
        raise SchemaOutdated(
            f"the database {where} is at schema revision {have or '(none)'}, not "
            f"{head_revision()}: run `ringtrain db upgrade --database-url ...` first"
        )
    if state == "ahead":
        log.warning(
            "the database schema is at %s, newer than this release's %s, which it declares it "
            "can run on (a rollback or a rollout in progress)",
            have,
            head_revision(),
        )
