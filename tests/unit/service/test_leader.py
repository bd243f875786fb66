"""The leader lease (`service.store.leases`, `service.leader`) on a real store: SQLite always,
PostgreSQL from the throwaway server of `tests/unit/service/test_store.py`.

Takeover only after expiry, one more epoch per takeover, fenced writes refused once the term is
over, a leader that cannot renew stops acting before anyone else starts, and a second replica on
SQLite refused while the first one's process lives.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from api.app import create_app
from service.db import make_engine, migrate
from service.launcher import LaunchRequest
from service.leader import Leadership, ReplicaRefused, refuse_second_sqlite_replica
from service.models import Transition
from service.settings import Settings
from service.store import Deposed, Store, StoreError
from service.store.database import WRITE_GUARD
from tests.support.api_harness import TOKENS
from tests.support.pg import fresh_pg_database
from tests.unit.service.test_store import SPEC
from workers.protocol import JobState


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/lease.db"
    return fresh_pg_database(request.getfixturevalue("postgres_server"))


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    engine = make_engine(url)
    migrate(engine)
    yield Store(engine)
    engine.dispose()


def test_lease_is_taken_only_after_expiry_and_each_takeover_is_a_new_epoch(store: Store) -> None:
    a = store.leases.acquire("replica-a", 0.5)
    assert (a.holder, a.epoch) == ("replica-a", 1) and a.live
    b = store.leases.acquire("replica-b", 0.5)
    assert (b.holder, b.epoch) == ("replica-a", 1)  # live: not taken
    assert store.leases.renew("replica-a", 1, 0.5) is not None
    time.sleep(0.7)  # a's lease runs out (nobody renews it)
    b = store.leases.acquire("replica-b", 0.5)
    assert (b.holder, b.epoch) == ("replica-b", 2)
    assert store.leases.renew("replica-a", 1, 0.5) is None  # a learns it was deposed
    assert not store.leases.release("replica-a", 1)
    again = store.leases.acquire("replica-b", 0.5)  # re-acquiring one's own lease: a new term
    assert (again.holder, again.epoch) == ("replica-b", 3)
    assert store.leases.release("replica-b", 3)
    c = store.leases.acquire("replica-c", 0.5)  # released: taken at once
    assert (c.holder, c.epoch) == ("replica-c", 4)


def test_fenced_write_of_an_old_epoch_is_refused_and_leaves_nothing(store: Store) -> None:
    job = store.jobs.create("alice", SPEC, "tok")
    store.leases.acquire("replica-a", 0.3)
    ok = WRITE_GUARD.set(lambda s: store.leases.check(s, "replica-a", 1))
    try:
        assert store.jobs.transition(job.id, JobState.PLACING, "submitted by a")
    finally:
        WRITE_GUARD.reset(ok)
    time.sleep(0.5)
    store.leases.acquire("replica-b", 0.3)  # b takes over (epoch 2)
    old = WRITE_GUARD.set(lambda s: store.leases.check(s, "replica-a", 1))
    try:
        with pytest.raises(Deposed):
            store.jobs.transition(job.id, JobState.FAILED, "a deposed leader's write")
        with pytest.raises(Deposed):
            store.tokens.replace(job.id, "0" * 64)
    finally:
        WRITE_GUARD.reset(old)
    assert issubclass(Deposed, StoreError)
    got = store.jobs.get(job.id)
    assert got.state == "PLACING" and got.ingest_token_hash != "0" * 64 and got.error is None
    with store.db.read() as s:
        rows = s.scalars(select(Transition).where(Transition.job_id == job.id))
        moves = [t.to_state for t in rows]
    assert moves == ["QUEUED", "PLACING"]


def test_a_holders_old_epoch_is_refused_after_it_takes_the_lease_again(store: Store) -> None:
    """The fence is the term, not the holder: a replica that took the lease again (a new epoch) may
    still have a write in flight from its old term, and that write must be refused."""
    job = store.jobs.create("alice", SPEC, "tok")
    first = store.leases.acquire("replica-a", 30.0)
    again = store.leases.acquire("replica-a", 30.0)  # its own lease, taken again: a new term
    assert (first.epoch, again.epoch, again.holder) == (1, 2, "replica-a")
    old = WRITE_GUARD.set(lambda s: store.leases.check(s, "replica-a", 1))
    try:
        with pytest.raises(Deposed, match="epoch 1 of replica-a"):
            store.jobs.transition(job.id, JobState.FAILED, "a write of the old term")
        with pytest.raises(Deposed):
            store.tokens.replace(job.id, "0" * 64)
    finally:
        WRITE_GUARD.reset(old)
    got = store.jobs.get(job.id)
    assert got.state == "QUEUED" and got.ingest_token_hash != "0" * 64 and got.error is None
    current = WRITE_GUARD.set(lambda s: store.leases.check(s, "replica-a", 2))
    try:  # the same holder in its current term writes
        assert store.jobs.transition(job.id, JobState.PLACING, "a write of the new term")
    finally:
        WRITE_GUARD.reset(current)
    assert store.jobs.get(job.id).state == "PLACING"


class Loops:
    """Stands in for the controller: records when this replica starts and stops acting."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def elected(self, guard: object, acting: object) -> None:
        self.events.append(("elected", time.monotonic()))

    async def deposed(self) -> None:
        self.events.append(("deposed", time.monotonic()))


@pytest.mark.postgres
def test_a_leader_that_cannot_renew_stops_before_another_takes_over(postgres_server: str) -> None:
    """Two replicas (a store each, as two processes have); a's renewals start failing as if the
    database were out of its reach; a stops acting on its own before b takes over."""
    url = fresh_pg_database(postgres_server)
    engines = [make_engine(url), make_engine(url)]
    migrate(engines[0])
    store_a, store_b = Store(engines[0]), Store(engines[1])

    async def scenario() -> tuple[Loops, Loops, Leadership]:
        la, lb = Loops(), Loops()
        a = Leadership(store_a, lease_s=1.5, on_elected=la.elected, on_deposed=la.deposed)
        b = Leadership(store_b, lease_s=1.5, on_elected=lb.elected, on_deposed=lb.deposed)
        a.replica, b.replica = "a", "b"
        await a.start()
        assert await a.wait_elected(5)
        await b.start()
        await asyncio.sleep(0.5)
        assert not b.acting() and b.snapshot().role == "follower" and b.snapshot().holder == "a"
        assert a.snapshot().role == "leader" and a.snapshot().epoch == 1

        def unreachable(*args: object, **kw: object) -> None:
            raise StoreError("connection refused (injected)")

        store_a.leases.renew = unreachable  # type: ignore[method-assign,assignment]
        store_a.leases.acquire = unreachable  # type: ignore[method-assign,assignment]
        assert await b.wait_elected(10)
        assert b.snapshot().epoch == 2 and not a.acting()
        await a.stop()
        await b.stop()
        return la, lb, b

    la, lb, b = asyncio.run(scenario())
    for e in engines:
        e.dispose()
    stopped = dict(la.events)["deposed"]
    started = next(t for what, t in lb.events if what == "elected")
    print(f"\n[leader] a stopped acting {started - stopped:.2f}s before b took over (lease 1.5 s)")
    assert [w for w, _ in la.events] == ["elected", "deposed"]
    assert stopped < started  # the old leader stopped acting before the new one started
    assert b.snapshot().role == "follower"  # stopped: not leading any more


def test_second_replica_on_sqlite_is_refused_while_the_first_lives(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/rt.db"
    engine = make_engine(url)
    migrate(engine)
    store = Store(engine)
    host = socket.gethostname()
    other = subprocess.Popen(["sleep", "60"])
    try:
        store.leases.acquire("other-replica", 60, host=host, pid=other.pid)
        with pytest.raises(ReplicaRefused, match="PostgreSQL"):
            refuse_second_sqlite_replica(store, host, os.getpid())
        kw = {"api_tokens": TOKENS, "token_file": tmp_path / "t", "log_level": "WARNING"}
        settings = Settings(database_url=url, **kw)
        with pytest.raises(ReplicaRefused, match=r"SQLite holds one replica only"):
            create_app(settings)
    finally:
        other.kill()
        other.wait()
    refuse_second_sqlite_replica(store, host, os.getpid())  # its process is gone: no refusal
    view = store.leases.acquire(
        "me",
        60,
        host=host,
        pid=os.getpid(),
        stale=lambda v: v.host == host and v.pid == other.pid,
    )
    assert view.holder == "me" and view.epoch == 2
    engine.dispose()


def test_a_new_leader_adopts_a_driver_its_predecessor_submitted_but_did_not_record(
    tmp_path: Path,
) -> None:
    """The old leader minted the token and submitted, then died before storing the submission: the
    new leader finds that attempt's driver on the cluster and records it, keeping the token the
    driver holds (a new token would make every report of that driver a 401), submitting nothing."""
    from service.controller import Controller
    from service.store import hash_token
    from tests.support.api_harness import RecordingLauncher, make_settings

    class Submitted(RecordingLauncher):
        def find(self, job_id: str, attempt: int) -> str | None:
            return f"ringtrain-{job_id}-{attempt}"  # the cluster already runs it

    settings = make_settings(tmp_path)
    engine = make_engine(settings.database_url)
    migrate(engine)
    store = Store(engine)
    job = store.jobs.create("alice", SPEC, "tok")
    store.tokens.replace(job.id, hash_token("the-token-the-driver-holds"))
    launcher = Submitted()

    async def scenario() -> None:
        controller = Controller(settings, store, launcher)
        await controller.schedule_once()
        await asyncio.gather(*controller._submitting.values())

    asyncio.run(scenario())
    got = store.jobs.get(job.id)
    assert got.submission_id == f"ringtrain-{job.id}-0" and got.state == "PLACING"
    assert got.ingest_token_hash == hash_token("the-token-the-driver-holds")
    assert launcher.submits == []
    engine.dispose()


def test_a_failed_look_up_mints_no_token_and_the_running_driver_keeps_its_own(
    tmp_path: Path,
) -> None:
    """`launcher.find` raises (the cluster briefly unreachable) while the cluster already runs this
    attempt's driver: no new token is minted on a guess (Ray would answer the resubmission "already
    exists", i.e. success, and the driver's every report would be a 401); the look-up is retried,
    finds the driver, adopts it. A look-up that keeps failing fails the job after
    `submit_attempts` tries, like a submission, still with the token untouched."""
    from service.controller import Controller
    from service.store import hash_token
    from tests.support.api_harness import RecordingLauncher, make_settings

    class Unreachable(RecordingLauncher):
        def __init__(self, failures: int) -> None:
            super().__init__()
            self.failures, self.looks = failures, 0

        def find(self, job_id: str, attempt: int) -> str | None:
            self.looks += 1
            if self.looks <= self.failures:
                raise ConnectionError("Ray dashboard unreachable")
            return f"ringtrain-{job_id}-{attempt}"  # the earlier leader's submission runs

        def submit(self, req: LaunchRequest) -> str:  # Ray: "already exists" counts as success
            self.submits.append(req)
            return f"ringtrain-{req.job_id}-{req.attempt}"

    settings = make_settings(tmp_path, submit_attempts=2)
    engine = make_engine(settings.database_url)
    migrate(engine)
    store = Store(engine)
    held = hash_token("the-token-the-driver-holds")

    def scenario(launcher: Unreachable) -> str:
        job = store.jobs.create("alice", SPEC, "tok")
        store.tokens.replace(job.id, held)

        async def run() -> None:
            controller = Controller(settings, store, launcher)
            await controller.schedule_once()
            await asyncio.gather(*controller._submitting.values())

        asyncio.run(run())
        return job.id

    once = Unreachable(failures=1)
    jid = scenario(once)
    got = store.jobs.get(jid)
    assert once.looks == 2 and once.submits == []  # looked again (after 2 s), submitted nothing
    assert got.submission_id == f"ringtrain-{jid}-0" and got.state == "PLACING"
    assert got.ingest_token_hash == held  # the running driver's reports still authenticate

    down = Unreachable(failures=99)
    jid = scenario(down)
    got = store.jobs.get(jid)
    assert down.looks == 2 and down.submits == [] and got.ingest_token_hash == held
    assert got.state == "FAILED" and got.submission_id is None
    why = store.jobs.transitions(jid)[-1].reason
    assert why.startswith("cannot look for an earlier submission") and "gave up after 2" in why
    engine.dispose()
