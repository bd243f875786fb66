"""Rollback across schema revisions (`service.db`, rules in service/migrations/env.py): a newer release
upgrades the database with fake later migrations (a copy of the migrations folder plus one more file,
applied by the same `migrate` a newer release runs), then this release is started on it, as
`kubectl rollout undo` does: its init container's `ringtrain db upgrade` changes nothing and the app
starts and serves while the newer schema declares this release compatible; a newer revision outside
that window is refused by both, naming the release needed. SQLite always, PostgreSQL when available.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from api.app import create_app
from service import db
from service.db import (
    MIGRATIONS,
    MigrationLocked,
    SchemaOutdated,
    SchemaTooNew,
    alembic_config,
    current_revision,
    head_revision,
    make_engine,
    migrate,
    require_current,
    upgrade,
)
from tests.support.api_harness import TINY_SPEC, RecordingLauncher, make_settings, running
from tests.support.pg import fresh_pg_database

FAKE = '''"""A later release's migration (test).

Revision ID: {revision}
Revises: {parent}
"""

import sqlalchemy as sa
from alembic import op

revision = {revision!r}
down_revision = {parent!r}
branch_labels = None
depends_on = None
compatible_since = {since!r}


def upgrade() -> None:
{body}


def downgrade() -> None:
    pass
'''
EXPAND = "0007_future_expand"
CONTRACT = "0008_future_contract"
# an expand: a nullable column on jobs and a table of its own; this release's code ignores both
EXPAND_BODY = """    op.add_column("jobs", sa.Column("future_note", sa.String(200), nullable=True))
    op.create_table("future_things", sa.Column("id", sa.Integer(), primary_key=True))"""
# a contract: what this release writes no longer fits (a column it never fills, required)
CONTRACT_BODY = """    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("tenant", sa.String(64), nullable=False, server_default="x"))"""


def later_release(root: Path, *migrations: tuple[str, str, str]) -> Path:
    """This release's migrations folder plus (revision, compatible_since, upgrade body) files."""
    folder = root / f"migrations-{migrations[-1][0]}"
    shutil.copytree(MIGRATIONS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    parent = head_revision()
    for revision, since, body in migrations:
        text_ = FAKE.format(revision=revision, parent=parent, since=since, body=body)
        (folder / "versions" / f"{revision}.py").write_text(text_)
        parent = revision
    return folder


def upgrade_as(
    release: str, engine: Engine, migrations: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the later release's upgrade: its migrations, recorded as written by `release`."""
    with monkeypatch.context() as m:
        m.setattr(db, "release", lambda: release)
        migrate(engine, migrations=migrations)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/rollback.db"
    return fresh_pg_database(request.getfixturevalue("postgres_server"))


@pytest.fixture
def engine(url: str) -> Iterator[Engine]:
    e = make_engine(url)
    yield e
    e.dispose()


def test_every_migration_declares_the_oldest_revision_that_runs_on_it() -> None:
    """Each `compatible_since` is the migration itself or one before it, and never older than its
    parent's (a schema does not become readable again by code its parent locked out)."""
    script = ScriptDirectory.from_config(alembic_config())
    chain = list(reversed(list(script.walk_revisions())))
    order = {s.revision: i for i, s in enumerate(chain)}
    since = [order[db.compatible_since(script, s.revision)] for s in chain]
    assert all(s <= i for i, s in enumerate(since)), since
    assert since == sorted(since), since
    assert db.compatible_since(script, head_revision()) == "0005_leader_lease"


def test_this_release_runs_on_a_newer_schema_within_its_window_and_refuses_one_beyond(
    url: str, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert upgrade(url) == head_revision()
    ours = head_revision()
    upgrade_as("0.2.0", engine, later_release(tmp_path, (EXPAND, ours, EXPAND_BODY)), monkeypatch)
    assert current_revision(engine) == EXPAND
    with engine.connect() as c:
        recorded = c.execute(
            text("SELECT revision, compatible_since, written_by FROM schema_compat")
        ).all()
    assert recorded == [(EXPAND, ours, "0.2.0")]

    # the rollback: this release's init container, then its app
    assert upgrade(url) == EXPAND  # nothing to do: the newer schema stays as it is
    assert current_revision(engine) == EXPAND and "future_note" in {
        c["name"] for c in inspect(engine).get_columns("jobs")
    }
    require_current(engine)
    with running(tmp_path, database_url=url) as srv:
        c = srv.client()
        r = c.post("/v1/jobs", json=TINY_SPEC)
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        assert c.get(f"/v1/jobs/{jid}").json()["state"] in ("QUEUED", "PLACING")
        assert [j["id"] for j in c.get("/v1/jobs").json()["jobs"]] == [jid]
        assert srv.client(None).get("/readyz").json() == {"status": "ready", "store": "ok"}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT future_note FROM jobs")).all() == [(None,)]

    # a later release contracts: the window now starts at its own revision
    later = later_release(
        tmp_path, (EXPAND, ours, EXPAND_BODY), (CONTRACT, CONTRACT, CONTRACT_BODY)
    )
    upgrade_as("0.3.0", engine, later, monkeypatch)
    assert current_revision(engine) == CONTRACT
    needed = rf"by ringtrain 0\.3\.0.*run ringtrain 0\.3\.0 \(or a release whose migrations include {CONTRACT}\)"
    with pytest.raises(SchemaTooNew, match=needed):
        upgrade(url)
    with pytest.raises(SchemaTooNew, match=rf"has schema revisions up to {ours} only"):
        create_app(make_settings(tmp_path, database_url=url), RecordingLauncher())
    assert current_revision(engine) == CONTRACT  # refused, untouched


def test_a_newer_revision_that_records_no_window_is_refused(
    url: str, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upgrade(url)
    upgrade_as(
        "0.2.0",
        engine,
        later_release(tmp_path, (EXPAND, head_revision(), EXPAND_BODY)),
        monkeypatch,
    )
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM schema_compat"))  # e.g. set by hand with `alembic stamp`
    with pytest.raises(SchemaTooNew, match="records no older release that can run on it"):
        require_current(engine)


def test_an_older_schema_still_asks_for_the_upgrade(url: str, engine: Engine) -> None:
    assert current_revision(engine) is None  # a fresh database, at nothing
    with pytest.raises(SchemaOutdated, match="ringtrain db upgrade"):
        require_current(engine)


@pytest.mark.postgres
def test_an_upgrade_that_cannot_get_its_table_gives_up_and_changes_nothing(
    postgres_server: str, tmp_path: Path
) -> None:
    """A long transaction holds the jobs table; the upgrade's ALTER TABLE waits for it only
    `ddl_lock_timeout_s`, instead of queueing every later query on jobs behind itself."""
    url = fresh_pg_database(postgres_server)
    upgrade(url)
    engine = make_engine(url)
    later = later_release(tmp_path, (EXPAND, head_revision(), EXPAND_BODY))
    with engine.connect() as reader:
        reader.execute(text("SELECT count(*) FROM jobs"))  # its transaction stays open
        t0 = time.monotonic()
        with pytest.raises(MigrationLocked, match=r"stayed locked for over 0\.5 s"):
            migrate(engine, migrations=later, ddl_lock_timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
        reader.rollback()
    assert current_revision(engine) == head_revision()  # rolled back whole
    migrate(engine, migrations=later, ddl_lock_timeout_s=0.5)
    assert current_revision(engine) == EXPAND
    engine.dispose()
