"""The per-job driver: `python -m workers.driver`, started by the control plane as a Ray job.

Environment (set by `service.ray_jobs.RayJobLauncher` in the job's runtime_env):
  RINGTRAIN_JOB_ID, RINGTRAIN_CONTROL_URL, RINGTRAIN_INGEST_TOKEN, RINGTRAIN_CHECKPOINT_DIR (this job's own dir),
  RINGTRAIN_JOB_SPEC (the JobSpec as JSON), RINGTRAIN_PLACEMENT_TIMEOUT_S, optionally RINGTRAIN_ATTEMPT and
  RINGTRAIN_RESTARTS (restarts earlier drivers of this job used; a resubmitted driver only gets the rest) and
  RINGTRAIN_RESUME_MAX_STEP (steps whose points the control plane holds: a resubmitted driver resumes at or before).

What it does, and why here (SPEC §4): the driver lives on the cluster so a job survives control-plane restarts.
It reserves one placement group (one bundle per rank), starts one `RankActor` per bundle, orders ranks by where
they landed (`placement`), runs training, forwards metrics and state changes through `Reporter`, and
recovers from lost ranks: tear everything down, report RETRYING with the checkpoint step to resume from, reserve
again, up to `spec.max_restarts`. Any other failure ends in FAILED with the message; SIGTERM (Ray job stop) ends in
CANCELLED after releasing actors and the placement group within seconds. No path waits forever.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from workers.config import JobSpec
from workers.orchestration.actor import remote_rank_actor
from workers.orchestration.placement import (
    RankAssignment,
    WorkerLocation,
    capacity_shortfall,
    choose_strategy,
    dist_backend,
    make_bundles,
    node_crossings,
    nodes_per_ring,
    order_ranks,
)
from workers.orchestration.reporter import Reporter
from workers.protocol import JobState, MetricPoint, RankPlacement

log = logging.getLogger("ringtrain.driver")

ACTOR_NAMESPACE = "ringtrain"
MAX_LOG_LINES = 2000  # driver log lines forwarded to the control plane per driver run


class Cancelled(Exception):
    """SIGTERM / stop requested."""


class PlacementTimeout(Exception):
    pass


class RankLost(Exception):
    """A rank actor or its node died: recoverable by re-reserving and resuming from the checkpoint."""


class TrainingError(Exception):
    """The training code raised: not retried (it would raise again)."""


# Ray errors that mean "the process/node is gone", not "the code raised".
def _lost_errors() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rx

    names = (
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "ObjectLostError",
        "OwnerDiedError",
        "LocalRayletDiedError",
    )
    return tuple(getattr(rx, n) for n in names if hasattr(rx, n))


@dataclass
class DriverConfig:
    job_id: str
    control_url: str
    ingest_token: str
    checkpoint_dir: str
    spec: JobSpec
    placement_timeout_s: float = 600.0
    attempt: int = 0
    restarts_used: int = 0
    resume_max_step: int | None = None
    poll_interval_s: float = 0.5
    actor_start_timeout_s: float = 300.0
    stop_grace_s: float = 4.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> DriverConfig:
        env = dict(os.environ if env is None else env)
        missing = [
            k
            for k in (
                "RINGTRAIN_JOB_ID",
                "RINGTRAIN_CONTROL_URL",
                "RINGTRAIN_INGEST_TOKEN",
                "RINGTRAIN_CHECKPOINT_DIR",
                "RINGTRAIN_JOB_SPEC",
            )
            if not env.get(k)
        ]
        if missing:
            raise SystemExit(f"workers.driver: missing environment variables: {', '.join(missing)}")
        return cls(
            job_id=env["RINGTRAIN_JOB_ID"],
            control_url=env["RINGTRAIN_CONTROL_URL"],
            ingest_token=env["RINGTRAIN_INGEST_TOKEN"],
            checkpoint_dir=env["RINGTRAIN_CHECKPOINT_DIR"],
            spec=JobSpec.model_validate_json(env["RINGTRAIN_JOB_SPEC"]),
            placement_timeout_s=float(env.get("RINGTRAIN_PLACEMENT_TIMEOUT_S", "600")),
            attempt=int(env.get("RINGTRAIN_ATTEMPT", "0")),
            restarts_used=int(env.get("RINGTRAIN_RESTARTS", "0")),
            resume_max_step=int(env["RINGTRAIN_RESUME_MAX_STEP"]) if env.get("RINGTRAIN_RESUME_MAX_STEP") else None,
        )


@dataclass
class RankGroup:
    """One reservation: the placement group, its actors (bundle order) and the rank assignment."""

    pg: Any
    actors: list[Any]
    locations: list[WorkerLocation] = field(default_factory=list)
    assignments: list[RankAssignment] = field(default_factory=list)  # by rank
    strategy: str = ""
    backend: str = "gloo"
    attention_backend: str = ""
    pids: list[int] = field(default_factory=list)

    def actor(self, rank: int) -> Any:
        return self.actors[self.assignments[rank].actor_index]

    def placement(self) -> list[RankPlacement]:
        return [
            RankPlacement(rank=a.rank, node_id=a.node_id, node_ip=a.node_ip, device=a.device, ring=a.ring)
            for a in self.assignments
        ]

    def teardown(self) -> None:
        """Kill actors and remove the placement group (idempotent, never raises)."""
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


def _resolve_accelerator(spec: JobSpec) -> bool:
    """True = one GPU per rank. `auto` uses GPUs when the cluster has at least one per rank."""
    acc = spec.resources.accelerator
    if acc == "gpu":
        return True
    if acc == "cpu":
        return False
    return ray.cluster_resources().get("GPU", 0.0) >= spec.world_size


def reserve(
    spec: JobSpec,
    *,
    name: str,
    timeout_s: float,
    on_waiting: Callable[[str], None] = lambda reason: None,
    cancelled: Callable[[], bool] = lambda: False,
    actor_start_timeout_s: float = 300.0,
) -> RankGroup:
    """Reserve the placement group, start one actor per bundle, read their locations and order the ranks.

    `on_waiting(reason)` is called once before waiting for the group (the PLACING reason). Raises PlacementTimeout,
    Cancelled or RankLost; releases whatever it created when it raises.
    """
    world = spec.world_size
    gpu = _resolve_accelerator(spec)
    bundles = make_bundles(world, gpu=gpu, cpus_per_worker=spec.resources.cpus_per_worker)
    nodes_total = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    strategy = choose_strategy(world, bundles[0], nodes_total)
    shortfall = capacity_shortfall(world, bundles[0], nodes_total)
    want = ", ".join(f"{v:g} {k}" for k, v in bundles[0].items())
    reason = f"waiting for resources: {world} rank(s) × ({want}), {strategy}"
    if shortfall:
        reason += f"; {shortfall}"
    pg = placement_group(bundles, strategy=strategy, name=name)
    group = RankGroup(pg=pg, actors=[], strategy=strategy)
    try:
        on_waiting(reason)
        deadline = time.monotonic() + timeout_s
        ready = pg.ready()
        while True:
            done, _ = ray.wait([ready], timeout=0.5)
            if done:
                break
            if cancelled():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise PlacementTimeout(
                    f"could not place {world} rank(s) × ({want}) within {timeout_s:g}s "
                    f"({strategy}): {shortfall or 'the cluster resources stayed busy'}"
                )
        bundle_gpus = bundles[0].get("GPU", 0.0)
        group.actors = [
            remote_rank_actor(
                num_cpus=bundles[0]["CPU"],
                num_gpus=bundle_gpus,
                placement_group=pg,
                bundle_index=i,
                name=f"{name}-b{i}",
                namespace=ACTOR_NAMESPACE,
            )
            for i in range(world)
        ]
        infos = _get([a.info.remote() for a in group.actors], actor_start_timeout_s, cancelled)
        group.locations = [WorkerLocation(i["node_id"], i["node_ip"], tuple(i["gpu_ids"])) for i in infos]
        group.pids = [int(i["pid"]) for i in infos]
        group.assignments = order_ranks(group.locations, spec.parallel.ring_size, spec.parallel.data_parallel)
        group.backend = dist_backend(group.locations)
        return group
    except BaseException:
        group.teardown()
        raise


def _get(refs: list[Any], timeout_s: float, cancelled: Callable[[], bool]) -> list[Any]:
    """ray.get with a deadline, a cancel check, and lost-actor errors turned into RankLost."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        if cancelled():
            raise Cancelled()
        if time.monotonic() > deadline:
            raise RankLost(f"rank actors did not answer within {timeout_s:g}s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    try:
        return ray.get(refs)
    except _lost_errors() as e:
        raise RankLost(f"a rank actor died: {_short(e)}") from e


def _short(e: BaseException, n: int = 600) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else type(e).__name__
    return f"{type(e).__name__}: {head}"[:n]


def init_group(group: RankGroup, spec: JobSpec, cancelled: Callable[[], bool], timeout_s: float = 300.0) -> None:
    """Rendezvous: rank 0 picks a free port on its node; every rank joins the default process group."""
    rank0 = group.assignments[0]
    port = _get([group.actor(0).free_port.remote()], 60, cancelled)[0]
    refs = [
        group.actor(a.rank).setup.remote(
            rank=a.rank,
            world_size=len(group.assignments),
            local_rank=a.local_rank,
            local_world_size=a.local_world_size,
            visible_devices=list(a.visible_devices),
            device=a.device,
            master_addr=rank0.node_ip,
            master_port=port,
            backend=group.backend,
            timeout_s=timeout_s,
        )
        for a in group.assignments
    ]
    _get(refs, timeout_s, cancelled)
    try:
        group.attention_backend = str(_get([group.actor(0).attention_backend.remote()], 60, cancelled)[0])
    except (RankLost, Cancelled):
        raise
    except Exception:
        group.attention_backend = "unknown"


class JobDriver:
    def __init__(self, cfg: DriverConfig, reporter: Reporter, cancel: threading.Event) -> None:
        self.cfg = cfg
        self.spec = cfg.spec
        self.reporter = reporter
        self.cancel = cancel
        self.group: RankGroup | None = None
        self.restarts = cfg.restarts_used
        self.last_step = 0  # newest step of the global points forwarded to the reporter
        self._rank_steps: dict[int, int] = {}  # newest step of each rank's own points forwarded
        self._train_refs: list[Any] = []

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def _resume_step(self) -> int:
        from workers.training.checkpoint import latest_step

        try:
            return latest_step(self.cfg.checkpoint_dir) or 0
        except FileNotFoundError:
            return 0

    def _safe_resume_step(self, through: int) -> int:
        """The checkpoint to resume from, never past `through` (see `workers.training.checkpoint.resume_point`)."""
        from workers.training.checkpoint import resume_point

        newest = self._resume_step()
        ev = self.spec.eval.every_steps if self.spec.eval.enabled else 0
        log.info(
            "choosing a resume point: points forwarded through step %d (global %d, per rank %s), newest checkpoint %d",
            through,
            self.last_step,
            dict(sorted(self._rank_steps.items())),
            newest,
        )
        step = resume_point(self.cfg.checkpoint_dir, through, ev)
        if step < newest:
            log.warning(
                "points after step %d were lost with a rank or driver: resuming from the checkpoint at step %d "
                "(not %d) so those steps run again",
                through,
                step,
                newest,
            )
        self.last_step = step
        self._rank_steps = {r: step for r in range(self.spec.world_size)}
        return step

    def _resume_with_journal(self) -> int:
        """After a lost rank: re-send from the ranks' journals the points the driver never drained (a dead rank
        takes its buffer with it), through the newest checkpoint, and resume from that checkpoint."""
        from workers.training.journal import read_journal

        step = self._resume_step()
        missing: list[tuple[int, int, MetricPoint]] = []
        for r in range(self.spec.world_size):
            for i, p in enumerate(read_journal(self.cfg.checkpoint_dir, r)):
                if (p.rank is None and r != 0) or (p.rank is not None and p.rank != r):
                    continue  # global metrics come from rank 0 only; per-rank ones from their own rank
                done = self.last_step if p.rank is None else self._rank_steps.get(p.rank, 0)
                if done < p.step <= step:
                    missing.append((p.step, r * 1_000_000 + i, p))
        for _, _, p in sorted(missing, key=lambda t: (t[0], t[1])):
            self.reporter.metric(p)
        log.info(
            "resuming from the checkpoint at step %d; re-sent %d undrained point(s) from the metrics journal "
            "(driver had forwarded through step %d, per rank %s)",
            step,
            len(missing),
            self.last_step,
            dict(sorted(self._rank_steps.items())),
        )
        self.last_step = step
        self._rank_steps = {r: step for r in range(self.spec.world_size)}
        return step

    def run(self) -> int:
        """Returns the process exit code: 0 for SUCCEEDED/CANCELLED, 1 for FAILED."""
        # A re-submitted driver (attempt > 0) continues from a checkpoint no newer than the points the control plane
        # holds (step 0 if none), and says so in its first report: its dead predecessor's later points are
        # superseded, not doubled, and none are missing.
        resume: int | None = None
        if self.cfg.attempt > 0:
            through = self.cfg.resume_max_step
            resume = self._safe_resume_step(through) if through is not None else self._resume_step()
        elif first := self._resume_step():
            resume = first
            self.last_step = first
            self._rank_steps = {r: first for r in range(self.spec.world_size)}
        while True:
            try:
                self.group = None
                attempt_name = f"rt-{self.cfg.job_id}-d{self.cfg.attempt}-r{self.restarts}"
                self.group = reserve(
                    self.spec,
                    name=attempt_name,
                    timeout_s=self.cfg.placement_timeout_s,
                    on_waiting=lambda reason, r=resume: self.reporter.state(JobState.PLACING, reason, resume_step=r),
                    cancelled=self.cancelled,
                    actor_start_timeout_s=self.cfg.actor_start_timeout_s,
                )
                init_group(self.group, self.spec, self.cancelled)
                self._report_running()
                result = self._train(self.group)
                self._teardown()
                if result.get("stopped") and self.cancelled():
                    raise Cancelled()
                meta: dict[str, str | int | float | bool] = {"final_step": int(result["final_step"])}
                if result.get("final_loss") is not None and math.isfinite(result["final_loss"]):
                    meta["final_loss"] = float(result["final_loss"])
                self.reporter.state(JobState.SUCCEEDED, f"finished at step {result['final_step']}", metadata=meta)
                log.info("job %s succeeded: %s", self.cfg.job_id, result)
                return 0
            except Cancelled:
                self._stop_gracefully()
                self.reporter.state(JobState.CANCELLED, "stopped on request (Ray job stop)")
                log.info("job %s cancelled", self.cfg.job_id)
                return 0
            except RankLost as e:
                self._salvage_metrics()
                self._teardown()  # before reading the checkpoint: no rank may still be writing one
                if self.restarts >= self.spec.max_restarts:
                    msg = f"rank lost and max_restarts ({self.spec.max_restarts}) reached: {e}"
                    self.reporter.state(JobState.FAILED, msg, error=msg)
                    log.error(msg)
                    return 1
                self.restarts += 1
                step = self._resume_with_journal()
                resume = None  # RETRYING carries it; PLACING after it need not repeat it
                reason = f"{e}; restart {self.restarts}/{self.spec.max_restarts}, resuming from step {step}"
                log.warning(reason)
                self.reporter.state(JobState.RETRYING, reason, resume_step=step, metadata={"restarts": self.restarts})
            except PlacementTimeout as e:
                self._teardown()
                self.reporter.state(JobState.FAILED, str(e), error=str(e))
                log.error("%s", e)
                return 1
            except TrainingError as e:
                self._teardown()
                self.reporter.state(JobState.FAILED, f"training failed: {_first_line(str(e))}", error=str(e))
                log.error("training failed: %s", e)
                return 1
            except Exception as e:  # a bug in the driver itself: still never leave the job hanging
                self._teardown()
                msg = f"driver error: {type(e).__name__}: {e}"
                self.reporter.state(JobState.FAILED, _first_line(msg), error=msg + "\n" + traceback.format_exc())
                log.exception("driver error")
                return 1

    def _report_running(self) -> None:
        g = self.group
        assert g is not None
        ring = self.spec.parallel.ring_size
        meta: dict[str, str | int | float | bool] = {
            "attention_backend": g.attention_backend,
            "dist_backend": g.backend,
            "placement_strategy": g.strategy,
            "nodes": len({a.node_id for a in g.assignments}),
            "ring_node_crossings": node_crossings(g.assignments, ring),
            "max_nodes_per_ring": max(nodes_per_ring(g.assignments, ring)),
            "restarts": self.restarts,
            "driver_attempt": self.cfg.attempt,
        }
        self.reporter.state(
            JobState.RUNNING,
            f"training on {meta['nodes']} node(s), {len(g.assignments)} rank(s)",
            placement=g.placement(),
            metadata=meta,
        )
        for a in g.assignments:
            log.info(
                "rank %d → node %s (%s) %s ring %d pid %d",
                a.rank,
                a.node_id[:12],
                a.node_ip,
                a.device,
                a.ring,
                g.pids[a.actor_index],
            )

    def _train(self, g: RankGroup) -> dict[str, Any]:
        spec_json = self.spec.model_dump_json()
        refs = {g.actor(r).train.remote(spec_json, self.cfg.checkpoint_dir): r for r in range(len(g.assignments))}
        self._train_refs = list(refs)
        pending = list(refs)
        results: dict[int, dict[str, Any]] = {}
        while pending:
            if self.cancelled():
                raise Cancelled()
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=self.cfg.poll_interval_s)
            self._forward_metrics(g)
            for ref in done:
                try:
                    results[refs[ref]] = ray.get(ref)
                except _lost_errors() as e:
                    raise RankLost(f"rank {refs[ref]} died: {_short(e)}") from e
                except ray.exceptions.RayTaskError as e:
                    # A peer's death often surfaces first as a communication error on a live rank.
                    if self._some_rank_dead(g):
                        raise RankLost(f"a rank died (rank {refs[ref]} saw: {_short(e.cause or e)})") from e
                    raise TrainingError(f"rank {refs[ref]}: {_cause_text(e)}") from e
        self._forward_metrics(g)
        return results[0]

    def _some_rank_dead(self, g: RankGroup, timeout_s: float = 5.0) -> bool:
        refs = [a.ping.remote() for a in g.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for r in refs:
            try:
                ray.get(r, timeout=0.1)
            except _lost_errors():
                return True
            except Exception:
                continue
        return False

    def _salvage_metrics(self) -> None:
        """After a rank died: forward what the surviving ranks still buffer (steps up to the checkpoint we resume
        from are not run again, so points left behind now would be missing for good)."""
        g = self.group
        if g is None or not g.actors or not g.assignments:
            return
        try:
            self._forward_metrics(g, tolerate_dead=True)
        except Exception as e:
            log.warning("could not collect metrics from surviving ranks: %s", _short(e))

    def _forward_metrics(self, g: RankGroup, tolerate_dead: bool = False) -> None:
        """Global points from rank 0, per-rank points (mem_peak_bytes) from every rank, in step order."""
        refs = [g.actor(r).drain_metrics.remote() for r in range(len(g.assignments))]
        points: list[tuple[int, int, MetricPoint]] = []
        lost: RankLost | None = None
        for r, ref in enumerate(refs):
            try:
                batch = ray.get(ref, timeout=10)
            except _lost_errors() as e:
                if lost is None and not tolerate_dead:
                    lost = RankLost(f"rank {r} died: {_short(e)}")
                    lost.__cause__ = e
                continue  # still forward what the other ranks gave us: their buffers are already drained
            except ray.exceptions.GetTimeoutError:
                continue
            for i, raw in enumerate(batch):
                p = MetricPoint.model_validate(raw)
                if r != 0 and p.rank is None:
                    continue  # global metrics come from rank 0 only
                points.append((p.step, r * 1_000_000 + i, p))
        for _, _, p in sorted(points, key=lambda t: (t[0], t[1])):
            self.reporter.metric(p)
            if p.rank is None:
                self.last_step = max(self.last_step, p.step)
            else:
                self._rank_steps[p.rank] = max(self._rank_steps.get(p.rank, 0), p.step)
        if lost is not None:
            raise lost

    def _stop_gracefully(self) -> None:
        """Ask ranks to stop (they finish the step and checkpoint), wait briefly, then release everything."""
        g = self.group
        if g is not None and g.actors and g.assignments:
            try:
                for a in g.actors:
                    a.request_stop.remote()
                if self._train_refs:  # they finish the current step and checkpoint
                    ray.wait(self._train_refs, num_returns=len(self._train_refs), timeout=self.cfg.stop_grace_s)
                self._forward_metrics(g)
            except Exception:
                pass
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
            pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = DriverConfig.from_env()
    cancel = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        cancel.set()

    # Before ray.init too (a stop during connect still ends as CANCELLED), and again after it: ray.init installs
    # its own SIGTERM handler, which would just sys.exit() and leave the job without a final state.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    reporter = Reporter(cfg.control_url, cfg.job_id, cfg.ingest_token)
    handler = _ReportLogHandler(reporter)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("ringtrain").addHandler(handler)
    log.info(
        "driver for job %s (attempt %d) starting: %s",
        cfg.job_id,
        cfg.attempt,
        json.dumps(
            {
                "world": cfg.spec.world_size,
                "ring": cfg.spec.parallel.ring_size,
                "dp": cfg.spec.parallel.data_parallel,
                "checkpoint_dir": cfg.checkpoint_dir,
            }
        ),
    )
    rc = 1
    try:
        os.makedirs(cfg.checkpoint_dir, exist_ok=True)
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
            rc = JobDriver(cfg, reporter, cancel).run()
    except SystemExit as e:
        if e.code in (signal.SIGTERM, int(signal.SIGTERM)) or cancel.is_set():  # stopped while connecting
            reporter.state(JobState.CANCELLED, "stopped on request before training started")
            rc = 0
        else:
            reporter.state(JobState.FAILED, f"driver exited: {e.code}", error=f"SystemExit({e.code})")
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
            print(f"warning: {reporter.pending()} report item(s) not delivered: {reporter.last_error}", flush=True)
        with contextlib.suppress(Exception):
            ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
