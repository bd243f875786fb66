"""A real store on a fresh SQLite file, migrated to the current schema: what a unit test of a route,
a middleware or a store reader runs on instead of a stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.db import make_engine, migrate
from service.store import Store
from service.store.events import EventBus


@contextmanager
def sqlite_store(directory: Path, bus: EventBus | None = None) -> Iterator[Store]:
    """A `Store` on `directory/ringtrain.db` (created and migrated), disposed of afterwards."""
    engine = make_engine(f"sqlite:///{directory}/ringtrain.db")
    migrate(engine)
    try:
        yield Store(engine, bus)
    finally:
        engine.dispose()
