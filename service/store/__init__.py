"""The durable job store: one module per aggregate over one database, every write one transaction
(a failed request leaves nothing behind).

    store.jobs     jobs.py     a job's row, transitions, queue notes, submissions, retries, cancels
    store.metrics  metrics.py  the event stream: driver reports in, metric points and logs out
    store.tokens   tokens.py   per-attempt ingest tokens (hashes only)
    store.audit    audit.py    who did what through the API
    store.leases   leases.py   the leader lease of the control plane (replicas)
    store.datasets datasets.py prepared datasets: one row per prepare run on the cluster
    store.evals    evals.py    evaluations: one row per RULER-style evaluation run on the cluster

Shared plumbing (sessions, the per-job write lock, event seqs) is `database.py`; events are built in
`events.py` only, and published after each commit to the listeners registered on the `EventBus`.
A new aggregate is a new module with a class taking the `Database`, plus one attribute here.
"""

from __future__ import annotations

from sqlalchemy import Engine

from service.store.audit import Audit
from service.store.database import Database
from service.store.datasets import Datasets
from service.store.errors import JobEnded, JobNotFound, ReportGap, StoreError
from service.store.evals import Evals
from service.store.events import Event, EventBus
from service.store.jobs import Jobs
from service.store.leases import Deposed, LeaseBusy, Leases, LeaseView
from service.store.metrics import Metrics, ReportResult, Series
from service.store.tokens import Tokens, hash_token

__all__ = [
    "Audit",
    "Database",
    "Datasets",
    "Deposed",
    "Evals",
    "Event",
    "EventBus",
    "JobEnded",
    "JobNotFound",
    "Jobs",
    "LeaseBusy",
    "LeaseView",
    "Leases",
    "Metrics",
    "ReportGap",
    "ReportResult",
    "Series",
    "Store",
    "StoreError",
    "Tokens",
    "hash_token",
]


class Store:
    """The aggregates over one engine; holds no logic of its own."""

    def __init__(self, engine: Engine, bus: EventBus | None = None) -> None:
        self.db = Database(engine, bus or EventBus())
        self.jobs = Jobs(self.db)
        self.metrics = Metrics(self.db)
        self.tokens = Tokens(self.db)
        self.audit = Audit(self.db)
        self.leases = Leases(self.db)
        self.datasets = Datasets(self.db)
        self.evals = Evals(self.db)

    @property
    def bus(self) -> EventBus:
        return self.db.bus
