"""Alembic environment: runs on the connection `service.db.migrate` passes, or on sqlalchemy.url.

Schema changes are expand-then-contract, so that a rollback can start: the release before a
migration must still run against the schema after it (`kubectl rollout undo`, or an old replica
that restarts mid-rollout, meets the newer schema).

- Expand (any release): add a table, a nullable column or one with a server default, an index;
  write new data in a form the old code ignores. The old code reads and writes the schema as before.
- Contract (a later release, once no release in the rollback window uses it): drop or rename a
  column or table, tighten a constraint, change what stored values mean. A rename is an expand
  (the new column, written by both), then a contract (the old one dropped) a release later.

Each migration declares `compatible_since`: the oldest revision whose code runs against the schema
it leaves. An expand copies its parent's value; a contract names the first revision whose code no
longer needs what it removes (often itself). After every run, `record_compatibility` stores the
current revision, its `compatible_since` and the release that wrote it in `schema_compat`, where
an older release reads it: it starts on a newer schema when its own migrations contain that
`compatible_since`, its `ringtrain db upgrade` then changes nothing, and otherwise both refuse,
naming the release needed (`service.db.require_current`). `schema_compat` itself only ever grows.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from service.db import make_engine, record_compatibility
from service.models import Base

config = context.config
target_metadata = Base.metadata


def migrate_on(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
        record_compatibility(connection, context.script)


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        migrate_on(conn)
        return
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("alembic needs a connection (service.db.migrate) or sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            migrate_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run()
