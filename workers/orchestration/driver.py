"""The per-job driver (`python -m workers.driver`), started by the control plane as a Ray job.

Why it lives on the cluster: a job survives control-plane restarts (ARCHITECTURE.md). The parts:
`reservation` (placement group, rank actors, rank order, rendezvous), `forwarding` (metric points to
the control plane through `reporter`), `recovery` (the one resume decision), and here the state
machine that ties them:

    PLACING → RUNNING → SUCCEEDED
       ↑         │ a rank lost
       │         ↓
       └──── RETRYING (resume from the newest checkpoint, up to max_restarts)

    any other failure → FAILED with the message;
    SIGTERM (Ray job stop) → CANCELLED, actors and group released.

A job with stages (`workers.config.stages`) runs each stage on a group placed for it: the ranks
train through the stages that share their number of ranks and return before one that needs
another; the driver releases the group and places the next (RUNNING → PLACING → RUNNING), which
resumes from the last stage's final checkpoint. A lost rank resumes in whichever stage that
checkpoint starts.

An elastic job (`elastic.enabled`) that loses a rank resumes on the largest of its shapes that
can be placed now (`workers.orchestration.elastic`), not only on its own; with `elastic.grow`,
while it runs smaller the driver watches the free resources and, once its own shape fits again,
stops the ranks (they checkpoint the step they finish) and places the job's own shape from that
checkpoint (RUNNING -> PLACING -> RUNNING, no step recomputed). Each resize is a state change whose
reason names both shapes and whose metadata carries `world_size`.

No path waits forever. The environment it starts with is `workers.protocol.DriverEnv`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Any

import ray

from workers.config import JobSpec
from workers.config.elastic import resized, shapes
from workers.orchestration import elastic
from workers.orchestration.actor import RankResult
from workers.orchestration.forwarding import MetricForwarder
from workers.orchestration.recovery import Delivered, ResumePlan, plan_resume
from workers.orchestration.reporter import Reporter
from workers.orchestration.reservation import (
    ACTOR_NAMESPACE,
    Cancelled,
    PlacementTimeout,
    RankGroup,
    RankLost,
    alive_node_resources,
    init_group,
    lost_errors,
    reserve,
    short,
    wants_gpus,
)
from workers.parallel_dims import ParallelDims, rank_bundle
from workers.protocol import DriverEnv, JobState
from workers.training.lease import Lease

log = logging.getLogger("ringtrain.driver")

MAX_LOG_LINES = 2000  # driver log lines forwarded to the control plane per driver run
Metadata = dict[str, str | int | float | bool]


class TrainingError(Exception):
    """The training code raised: not retried (it would raise again)."""


@dataclass(frozen=True)
class Timing:
    poll_interval_s: float = 0.5
    actor_start_timeout_s: float = 300.0
    stop_grace_s: float = 4.0
    grow_check_s: float = 2.0  # how often an elastic job running smaller looks for its own shape
    elastic_try_s: float = 15.0  # after a loss, how long a shape may wait before a smaller one
    release_wait_s: float = 3.0  # after a loss, how long Ray may take to show the group released


class JobDriver:
    def __init__(
        self, env: DriverEnv, reporter: Reporter, cancel: threading.Event, timing: Timing = Timing()
    ) -> None:
        self.env = env
        self.spec = env.job_spec
        self.reporter = reporter
        self.cancel = cancel
        self.timing = timing
        self.group: RankGroup | None = None
        self.restarts = env.restarts
        self.delivered = Delivered(self.spec.world_size, env.delivered_through)
        self.forwarder = MetricForwarder(reporter, self.delivered)
        self.gpu: bool | None = None  # decided at the first reservation, kept for every retry
        self.lease: Lease | None = (
            None  # this attempt's hold on the checkpoint directory (see `resume`)
        )
        self._train_refs: list[Any] = []
        self.shape: ParallelDims | None = None  # an elastic job's current shape; None: its own
        self.growing = False  # an elastic job stopped its ranks to grow back to its own shape
        self.fall_back = False  # the next reservation tries smaller shapes if its own waits
        self._grow_checked = 0.0

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def resume(self) -> ResumePlan:
        """Take the checkpoint directory (fencing off any cut-off ranks of earlier attempts), replay
        what the control plane lacks up to the newest checkpoint, and continue from that
        checkpoint."""
        self.lease = Lease.take(self.env.checkpoint_dir, f"d{self.env.attempt}-r{self.restarts}")
        plan = plan_resume(self.env.checkpoint_dir, self.delivered)
        log.info(
            "resuming from the checkpoint at step %d; replaying %d point(s) from the metrics "
            "journal (delivered through %s)",
            plan.step,
            len(plan.replay),
            self.delivered.summary(),
        )
        self.forwarder.send(plan.replay, replay=True)
        self.delivered.reset(plan.step)
        return plan

    def run(self) -> int:
        """Returns the process exit code: 0 for SUCCEEDED/CANCELLED, 1 for FAILED."""
        plan = self.resume()
        # A driver that is not the job's first run says where it resumes in its first report, so the
        # earlier run's later points go: a resubmitted driver (attempt > 0), or this attempt started
        # again by KubeRay after Kueue preempted it before its first checkpoint (its metrics journal
        # is already there).
        first_resume: int | None = (
            plan.step if (plan.step or self.env.attempt or plan.ran_before) else None
        )
        while True:
            try:
                self.group = None
                self.group = self._reserve(plan.step, first_resume)
                first_resume = None  # RETRYING carries it from here on
                init_group(self.group, self.cancelled)
                self._report_running(self.group, plan.step)
                result = self._train(self.group, plan.step)
                self._teardown()
                if result.stopped and self.cancelled():
                    raise Cancelled()
                if result.stopped and self.growing and result.final_step < self.spec.train.steps:
                    plan = self._grow(result.final_step)
                    continue
                # (stopped to grow at its last step: the job is done, nothing left to place)
                if not result.stopped and result.final_step < self.spec.train.steps:
                    # the next stage needs another number of ranks: place it and go on
                    plan = ResumePlan(step=result.final_step, replay=[])
                    continue
                return self._succeeded(result)
            except Cancelled:
                self._stop_gracefully()
                self.reporter.state(JobState.CANCELLED, "stopped on request (Ray job stop)")
                log.info("job %s cancelled", self.env.job_id)
                return 0
            except RankLost as e:
                self.forwarder.salvage(self.group)
                self._teardown()  # before reading the checkpoints: no rank may still be writing one
                if self.restarts >= self.spec.max_restarts:
                    return self._failed(
                        f"rank lost and max_restarts ({self.spec.max_restarts}) reached: {e}"
                    )
                self.restarts += 1
                plan = self.resume()
                reason = (
                    f"{e}; restart {self.restarts}/{self.spec.max_restarts}, "
                    f"resuming from step {plan.step}"
                )
                if self.spec.elastic.enabled:
                    reason += self._shrink(plan.step)
                log.warning(reason)
                self.reporter.state(
                    JobState.RETRYING,
                    reason,
                    resume_step=plan.step,
                    metadata={"restarts": self.restarts},
                )
            except PlacementTimeout as e:
                self._teardown()
                return self._failed(str(e))
            except TrainingError as e:
                self._teardown()
                return self._failed(f"training failed: {_first_line(str(e))}", detail=str(e))
            except Exception as e:  # a bug in the driver itself: still never leave the job hanging
                self._teardown()
                msg = f"driver error: {type(e).__name__}: {e}"
                return self._failed(_first_line(msg), detail=msg + "\n" + traceback.format_exc())

    def running_spec(self, step: int) -> JobSpec:
        """The spec the ranks run after `step`: the stage's, on an elastic job's current shape."""
        spec = self.spec.stage_at(step).spec
        return spec if self.shape is None else resized(spec, self.shape)

    def _free(self) -> elastic.NodeResources:
        from ray._private.state import available_resources_per_node

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return {k: v for k, v in available_resources_per_node().items() if k in alive}

    def _shrink(self, step: int) -> str:
        """After a lost rank (the group released): the largest shape placeable now. Returns the
        words the RETRYING reason gains."""
        before = self.shape or ParallelDims.of(self.spec.parallel)
        gpu = bool(self.gpu)
        chosen = elastic.choose_shape(self.spec, self._released_free(), gpu=gpu)
        self.fall_back = True
        if chosen is None:
            self.shape = None
            return (
                f"; elastic: no shape of at least {self.spec.elastic.min_world_size or 1} "
                "rank(s) fits now, waiting for the job's own"
            )
        self.shape = None if chosen == ParallelDims.of(self.spec.parallel) else chosen
        if chosen == before:
            return f"; elastic: {chosen.world_size} rank(s) still fit"
        log.warning("elastic: %s -> %s from step %d", before.describe(), chosen.describe(), step)
        return (
            f"; elastic: resizing from {before.world_size} to {chosen.world_size} rank(s) "
            f"({before.describe()} -> {chosen.describe()})"
        )

    def _held(self, g: RankGroup | None) -> dict[str, dict[str, float]]:
        """What `g`'s ranks hold, per node."""
        rank = rank_bundle(gpu=bool(self.gpu), cpus_per_worker=self.spec.resources.cpus_per_worker)
        held: dict[str, dict[str, float]] = {}
        for a in g.assignments if g is not None else []:
            node = held.setdefault(a.node_id, {})
            for k, v in rank.items():
                node[k] = node.get(k, 0.0) + v
        return held

    def _released_free(self) -> elastic.NodeResources:
        """The free resources once Ray shows the released group's share back on each node that is
        still listed, or after `Timing.release_wait_s` (a lost node's raylet never reports it). Read
        at once, a live node's ranks would still count as taken: Ray's view lags the release."""
        held = self._held(self.group)
        deadline = time.monotonic() + self.timing.release_wait_s
        while True:
            free = self._free()
            waiting = [
                node
                for node, res in held.items()
                if node in free and any(free[node].get(k, 0.0) < v for k, v in res.items())
            ]
            if not waiting or time.monotonic() >= deadline:
                return free
            time.sleep(0.1)

    def _should_grow(self, g: RankGroup) -> bool:
        """An elastic job running smaller whose own shape fits now (its group given back)."""
        if self.shape is None or not self.spec.elastic.grow or self.growing:
            return False
        now = time.monotonic()
        if now - self._grow_checked < self.timing.grow_check_s:
            return False
        self._grow_checked = now
        free = elastic.add(self._free(), self._held(g))
        own = ParallelDims.of(self.spec.parallel)
        return elastic.placeable(self.spec, own, free, gpu=bool(self.gpu))

    def _grow(self, step: int) -> ResumePlan:
        """The ranks stopped with a checkpoint at `step`: place the job's own shape from it."""
        before, own = self.shape, ParallelDims.of(self.spec.parallel)
        assert before is not None
        self.shape, self.growing = None, False
        reason = (
            f"elastic: capacity for {own.world_size} rank(s) is back; resizing from "
            f"{before.world_size} to {own.world_size} rank(s) ({before.describe()} -> "
            f"{own.describe()}) from the checkpoint at step {step}"
        )
        log.info(reason)
        self.reporter.state(JobState.PLACING, reason, metadata={"world_size": own.world_size})
        return ResumePlan(step=step, replay=[])

    def _reserve(self, step: int, resume_step: int | None) -> RankGroup:
        """The group for the stage that runs after `step` (the whole job without stages)."""
        stage = self.spec.stage_at(step)
        if self.gpu is None:
            self.gpu = wants_gpus(self.spec, alive_node_resources())
        attempt_name = f"rt-{self.env.job_id}-d{self.env.attempt}-r{self.restarts}"
        which = ""
        if self.spec.stages:
            attempt_name += f"-s{stage.index}"
            which = (
                f"stage {stage.index + 1}/{len(self.spec.stages)} ({stage.name}) from step {step}: "
            )
        while True:
            # After a loss, an elastic job gives each shape but its smallest a short wait: what
            # Ray reported free a moment ago may be taken by then (a queued group, another job)
            smaller = self._smaller_shapes() if self.fall_back else []
            try:
                group = reserve(
                    self.running_spec(step),
                    name=attempt_name + (f"-w{self.shape.world_size}" if self.shape else ""),
                    timeout_s=(
                        self.timing.elastic_try_s if smaller else self.env.placement_timeout_s
                    ),
                    gpu=self.gpu,
                    on_waiting=lambda reason: self.reporter.state(
                        JobState.PLACING, which + reason, resume_step=resume_step
                    ),
                    cancelled=self.cancelled,
                    actor_start_timeout_s=self.timing.actor_start_timeout_s,
                )
                self.fall_back = False
                return group
            except PlacementTimeout:
                if not smaller:
                    raise
                fits = [
                    d
                    for d in smaller
                    if elastic.placeable(self.spec, d, self._free(), gpu=bool(self.gpu))
                ]
                self.shape = (fits or smaller)[0]
                log.warning("elastic: not placed in time; trying %s", self.shape.describe())

    def _smaller_shapes(self) -> list[ParallelDims]:
        """An elastic job's shapes below the one it is about to reserve."""
        current = self.shape or ParallelDims.of(self.spec.parallel)
        return [d for d in shapes(self.spec) if d.world_size < current.world_size]

    def _succeeded(self, result: RankResult) -> int:
        meta: Metadata = {"final_step": result.final_step}
        if result.final_loss is not None and math.isfinite(result.final_loss):
            meta["final_loss"] = result.final_loss
        self.reporter.state(
            JobState.SUCCEEDED, f"finished at step {result.final_step}", metadata=meta
        )
        log.info("job %s succeeded: %s", self.env.job_id, result)
        return 0

    def _failed(self, reason: str, detail: str | None = None) -> int:
        self.reporter.state(JobState.FAILED, reason, error=detail or reason)
        log.error("%s", detail or reason)
        return 1

    def _report_running(self, g: RankGroup, step: int) -> None:
        stage = self.spec.stage_at(step)
        dims = ParallelDims.of(self.running_spec(step).parallel)
        meta: Metadata = {
            "attention_backend": g.attention_backend,
            "dist_backend": g.backend,
            "accelerator": "gpu" if self.gpu else "cpu",
            "placement_strategy": g.strategy,
            "nodes": len({a.node_id for a in g.assignments}),
            "ring_node_crossings": dims.node_crossings(g.assignments),
            "max_nodes_per_ring": max(dims.nodes_per_ring(g.assignments)),
            "restarts": self.restarts,
            "driver_attempt": self.env.attempt,
            "world_size": dims.world_size,
        }
        where = f"training on {meta['nodes']} node(s), {len(g.assignments)} rank(s)"
        if self.shape is not None:
            own = ParallelDims.of(self.spec.parallel)
            where += f" (elastic: {dims.describe()}; the job's own shape has {own.world_size})"
        if self.spec.stages:
            meta["stage"] = stage.index
            where = f"stage {stage.index + 1}/{len(self.spec.stages)} ({stage.name}): {where}"
        self.reporter.state(
            JobState.RUNNING,
            where,
            placement=g.placement(),
            metadata=meta,
        )
        for a in g.assignments:
            log.info(
                "rank %d -> node %s (%s) %s replica %d pid %d",
                a.rank, a.node_id[:12], a.node_ip, a.device, a.replica, g.pids[a.actor_index],
            )  # fmt: skip

    def _train(self, g: RankGroup, resume_step: int) -> RankResult:
        spec = self.spec if self.shape is None else resized(self.spec, self.shape)
        spec_json = spec.model_dump_json()
        refs = {
            a.train.remote(spec_json, self.env.checkpoint_dir, resume_step, lease=self.lease): r
            for r, a in enumerate(g.ranked_actors())
        }
        self._train_refs = list(refs)
        pending = list(refs)
        results: dict[int, RankResult] = {}
        while pending:
            if self.cancelled():
                raise Cancelled()
            done, pending = ray.wait(
                pending, num_returns=len(pending), timeout=self.timing.poll_interval_s
            )
            self.forwarder.drain(g)
            if self._should_grow(g):
                self.growing = True
                log.info("elastic: the job's own shape fits again; stopping the ranks to grow")
                for a in g.actors:
                    a.request_stop.remote()
            for ref in done:
                rank = refs[ref]
                try:
                    results[rank] = ray.get(ref)
                except lost_errors() as e:
                    raise RankLost(f"rank {rank} died: {short(e)}") from e
                except ray.exceptions.RayTaskError as e:
                    # A peer's death often surfaces first as a communication error on a live rank.
                    if self._some_rank_dead(g):
                        raise RankLost(
                            f"a rank died (rank {rank} saw: {short(e.cause or e)})"
                        ) from e
                    # what the ranks emitted before failing (a failed verification's points) goes
                    # out: the forwarder holds a step until every rank reports it, and a rank that
                    # failed reports nothing more
                    self.forwarder.salvage(g)
                    raise TrainingError(f"rank {rank}: {_cause_text(e)}") from e
        self.forwarder.drain(g, final=True)
        return results[0]

    def _some_rank_dead(self, g: RankGroup, timeout_s: float = 5.0) -> bool:
        refs = [a.ping.remote() for a in g.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for r in refs:
            try:
                ray.get(r, timeout=0.1)
            except lost_errors():
                return True
            except ray.exceptions.RayError:  # busy (a timeout) or its ping raised: alive
                continue
        return False

    def _stop_gracefully(self) -> None:
        """Ask ranks to stop (they finish the step and checkpoint), wait briefly, then release
        everything."""
        g = self.group
        if g is not None and g.actors and g.assignments:
            try:
                for a in g.actors:
                    a.request_stop.remote()
                if self._train_refs:
                    ray.wait(
                        self._train_refs,
                        num_returns=len(self._train_refs),
                        timeout=self.timing.stop_grace_s,
                    )
                self.forwarder.drain(g, final=True)
            except Exception as e:  # the ranks are released below whatever happened here
                log.warning("stopping the ranks gracefully failed (%s); releasing them", short(e))
        self._teardown()

    def _teardown(self) -> None:
        if self.group is not None:
            self.group.teardown()


def _first_line(s: str) -> str:
    return (s.strip().splitlines() or [""])[0][:4000]


def _cause_text(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return str(e)


class _ReportLogHandler(logging.Handler):
    """Forward driver log lines to the control plane (bounded per run)."""

    def __init__(self, reporter: Reporter, limit: int = MAX_LOG_LINES) -> None:
        super().__init__(level=logging.INFO)
        self.reporter = reporter
        self.left = limit

    def emit(self, record: logging.LogRecord) -> None:
        if self.left <= 0:
            return
        self.left -= 1
        try:
            line = self.format(record)
            if self.left == 0:
                line += f" [log forwarding limit of {MAX_LOG_LINES} lines reached]"
            self.reporter.log(line)
        except Exception:
            self.handleError(record)  # logging's own report of a failing handler, on stderr


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        env = DriverEnv()  # fields come from the RINGTRAIN_* environment
    except ValueError as e:
        raise SystemExit(f"workers.driver: bad or missing RINGTRAIN_* environment: {e}") from None
    cancel = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        cancel.set()

    # Before ray.init too (a stop during connect still ends as CANCELLED), and again after it:
    # ray.init installs its own SIGTERM handler, which would just sys.exit() and leave the job
    # without a final state.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    reporter = Reporter(env.control_url, env.job_id, env.ingest_token)
    handler = _ReportLogHandler(reporter)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("ringtrain").addHandler(handler)
    spec = env.job_spec
    log.info(
        "driver for job %s (attempt %d) starting: %s",
        env.job_id,
        env.attempt,
        json.dumps(
            {
                "world": spec.world_size,
                "ring": spec.parallel.ring_size,
                "ulysses": spec.parallel.ulysses_size,
                "dp": spec.parallel.data_parallel,
                "checkpoint_dir": env.checkpoint_dir,
            }
        ),
    )
    rc = 1
    try:
        env.check_version()  # fails the job, with what to do, on a half-upgraded cluster
        os.makedirs(env.checkpoint_dir, exist_ok=True)
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or "auto",
            namespace=ACTOR_NAMESPACE,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
        signal.signal(signal.SIGTERM, on_term)
        if cancel.is_set():
            reporter.state(JobState.CANCELLED, "stopped on request before training started")
            rc = 0
        else:
            rc = JobDriver(env, reporter, cancel).run()
    except SystemExit as e:
        if (
            e.code in (signal.SIGTERM, int(signal.SIGTERM)) or cancel.is_set()
        ):  # stopped while connecting
            reporter.state(JobState.CANCELLED, "stopped on request before training started")
            rc = 0
        else:
            reporter.state(
                JobState.FAILED, f"driver exited: {e.code}", error=f"SystemExit({e.code})"
            )
            rc = 1
    except BaseException as e:  # ray.init failed, or the like: report it rather than die silently
        msg = f"driver could not run: {type(e).__name__}: {e}"
        reporter.state(JobState.FAILED, _first_line(msg), error=msg + "\n" + traceback.format_exc())
        log.exception("driver could not run")
        rc = 1
    finally:
        logging.getLogger("ringtrain").removeHandler(handler)
        delivered = reporter.close(timeout_s=5.0 if cancel.is_set() else 30.0)
        if not delivered:
            print(
                f"warning: {reporter.pending()} report item(s) not delivered: "
                f"{reporter.last_error}",
                flush=True,
            )
        with contextlib.suppress(Exception):
            ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
