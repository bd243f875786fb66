"""Hands queued jobs to the launcher and reconciles the cluster's view with the store.

- scheduler: QUEUED jobs wait in the admission queue (`service.admission`: priority, then submission
  time; per-owner quotas; only what fits the cluster's free capacity now starts, so a queued job
  holds nothing — where each job brings its own cluster (Kueue mode) every job that fits the total
  goes to Kueue at once) and each waiting job's position and reason are stored; an admitted job (and
  an active job without a submission id: its driver was lost, or the control plane crashed) is
  submitted with a fresh per-job ingest token; Ray submission failures are retried with back-off,
  then the job FAILS with the launcher's message. A queued job the whole cluster can no longer hold
  (nodes lost) waits `queue_shrink_grace_s` for them, then FAILS with that reason.
- reconciler: for every active job, polls `launcher.status`. A driver that ended without reporting a
  terminal state (Ray SUCCEEDED/FAILED/STOPPED/UNKNOWN) ends the job FAILED (CANCELLED when a cancel
  was requested) after `reconcile_grace_s`, so a final report still in flight wins; a driver that
  FAILED (crashed, killed, its node lost) is resubmitted as the next attempt while the job has
  restarts left, and one Ray no longer knows (a replaced head) without using a restart (RETRYING;
  the new driver resumes from the last checkpoint and reports that step, which supersedes later
  points). A driver the queue in front of the cluster took back (Kueue preemption) moves its job to
  RETRYING until the same submission runs again. A cancel the driver never confirms is forced after
  `cancel_grace_s`. After a restart nothing special is needed: running drivers keep reporting to the
  same URL with their token and the reconciler picks their jobs up again.
- replicas: only the leader (`service.leader`) runs these loops; `start(guard, acting)` runs every
  store write of theirs under the term's fence and checks `acting()` before each pass and each Ray
  submission, so a deposed leader stops before another replica starts. A driver a previous leader
  submitted but did not record (it died in between) is adopted (`launcher.find`), keeping the ingest
  token that driver holds; a look-up that fails is retried like a submission (and counted with
  them), never followed by a new token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from service import admission, capacity
from service.launcher import ClusterInfo, DriverStatus, Launcher, LaunchRequest
from service.models import Job
from service.settings import Settings
from service.store import Deposed, JobNotFound, Store, StoreError, hash_token
from service.store.database import WRITE_GUARD, WriteGuard
from workers.config import SKIP_FILE_CHECKS, JobSpec
from workers.protocol import JobState

log = logging.getLogger("ringtrain.controller")


class _SubmitRefused(Exception):
    """One submission try failed; it is retried after a back-off."""


class _SubmitGaveUp(Exception):
    """Every submission try failed: the job fails with this message."""


class Controller:
    def __init__(self, settings: Settings, store: Store, launcher: Launcher) -> None:
        self.settings = settings
        self.store = store
        self.launcher = launcher
        self._wake = asyncio.Event()
        self._ended_seen: dict[str, float] = {}
        self._submitting: dict[str, asyncio.Task[None]] = {}
        self._specs: dict[str, JobSpec] = {}  # stored specs never change: validated once per job
        self._too_big_since: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._guard: WriteGuard | None = None
        self._acting: Callable[[], bool] = lambda: True

    # ---- lifecycle of the loops -----------------------------------------------------------------
    def start(
        self,
        guard: WriteGuard | None = None,
        acting: Callable[[], bool] | None = None,
    ) -> None:
        """Run the loops; `guard` fences every store write they make, `acting` says whether this
        replica still leads (both from `service.leader`; None: the only replica)."""
        self._guard, self._acting = guard, acting or (lambda: True)
        self._ended_seen.clear()  # a new term starts its grace periods afresh
        self._too_big_since.clear()
        self._tasks = [
            asyncio.create_task(self._loop(self.schedule_once, self.settings.scheduler_interval_s)),
            asyncio.create_task(
                self._loop(self.reconcile_once, self.settings.reconcile_interval_s)
            ),
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._submitting.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self, fn: Callable[[], Awaitable[None]], interval: float) -> None:
        WRITE_GUARD.set(self._guard)  # this task's context, and the tasks and threads it starts
        while True:
            try:
                if self._acting():
                    await fn()
            except asyncio.CancelledError:
                raise
            except Deposed as e:
                log.warning("control loop %s: %s", fn.__name__, e)
            except Exception:
                log.exception("control loop %s failed; retrying", fn.__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            self._wake.clear()

    # ---- scheduling -----------------------------------------------------------------------------
    async def schedule_once(self) -> None:
        """Admit what fits from the queue, and hand each admitted job without a driver to the
        launcher; each submission is its own task, so one job's back-off delays no other."""
        # Taken before the read: a submission that ends (and leaves `_submitting`) while the store
        # is read shows up there without its submission id, and must not be handed to the launcher a
        # second time.
        in_flight = set(self._submitting)
        active = await asyncio.to_thread(self.store.jobs.active)
        alive = {j.id for j in active}
        for cache in (self._specs, self._too_big_since):
            for jid in [k for k in cache if k not in alive]:
                del cache[jid]
        busy = in_flight | set(self._submitting)  # started before the read, or since
        queued: list[Job] = []
        for job in active:
            if job.submission_id is not None or job.cancel_requested or job.id in busy:
                continue
            if job.state == JobState.QUEUED.value:
                queued.append(job)
            else:  # already admitted: its driver was lost, it goes straight back to the launcher
                self._start(job)
        if queued:
            await self._admit(queued, [j for j in active if j not in queued])

    def _spec(self, job: Job) -> JobSpec:
        spec = self._specs.get(job.id)
        if spec is None:
            spec = self._specs[job.id] = JobSpec.model_validate(job.spec, context=SKIP_FILE_CHECKS)
        return spec

    def _start(self, job: Job) -> None:
        task = asyncio.create_task(self._submit(job.id, self._spec(job), job.attempt, job.restarts))
        self._submitting[job.id] = task
        task.add_done_callback(functools.partial(self._submission_ended, job.id))

    async def _admit(self, queued: list[Job], admitted: list[Job]) -> None:
        """One pass of the admission queue (`service.admission.decide`) against the cluster as Ray
        reports it now."""
        try:
            cluster = await asyncio.wait_for(asyncio.to_thread(self.launcher.cluster), timeout=10)
        except (
            Exception
        ) as e:  # Ray unreachable: nothing starts, nothing fails, the queue keeps its order
            why = (
                f"cannot read the cluster's capacity ({type(e).__name__}: {str(e)[:300]}); waiting"
            )
            ranked = admission.order([self._queued(j, ClusterInfo()) for j in queued])
            waiting = {q.job_id: (i + 1, why) for i, q in enumerate(ranked)}
            await asyncio.to_thread(self.store.jobs.set_queue, waiting)
            return
        cluster = admission.with_autoscaler(cluster, self.settings.autoscaler_nodes)
        now = time.time()
        placed: list[tuple[str, admission.Demand, int]] = []
        pending: list[admission.Demand] = []
        owners: list[admission.Admitted] = []
        for job in admitted:
            d = admission.demand_of(self._spec(job), admission.uses_gpus(self._spec(job), cluster))
            owners.append(admission.Admitted(job.id, job.owner, d))
            if job.state == JobState.RUNNING.value and job.placement:
                per_node: dict[str, int] = {}
                for p in job.placement:
                    per_node[str(p.get("node_id"))] = per_node.get(str(p.get("node_id")), 0) + 1
                placed += [(nid, d, n) for nid, n in per_node.items()]
            else:  # not placed yet (or not reported)
                pending.append(d)  # charged to the ledger where it most likely lands
        free = None if cluster.per_job_clusters else admission.free_nodes(cluster, placed, pending)
        jobs = {j.id: j for j in queued}
        decision = admission.decide(
            [self._queued(j, cluster) for j in queued],
            owners,
            free,
            admission.total_nodes(cluster),
            self.settings.quotas,
            now,
            self.settings.queue_reserve_after_s,
        )
        updates: dict[str, tuple[int | None, str | None]] = dict(decision.waiting)
        updates.update({jid: (None, None) for jid in decision.start})
        await asyncio.to_thread(self.store.jobs.set_queue, updates)
        for jid in decision.start:
            log.info("job %s: admitted (%s)", jid, jobs[jid].name)
            await self._resolve_accelerator(jid, cluster)
            self._start(jobs[jid])
        await self._fail_too_big(decision, now)

    async def _resolve_accelerator(self, job_id: str, cluster: ClusterInfo) -> None:
        """A job submitted while the cluster could not be read still says `auto`: decide it now,
        once, and store it."""
        spec = self._specs[job_id]
        resolved = capacity.with_accelerator_resolved(spec, cluster)
        if resolved is not spec:
            chosen = resolved.resources.accelerator
            await asyncio.to_thread(self.store.jobs.set_accelerator, job_id, chosen)
            self._specs[job_id] = resolved

    def _queued(self, job: Job, cluster: ClusterInfo) -> admission.Queued:
        spec = self._spec(job)
        d = admission.demand_of(spec, admission.uses_gpus(spec, cluster))
        return admission.Queued(job.id, job.owner, job.priority, job.created_at, d)

    async def _fail_too_big(self, decision: admission.Decision, now: float) -> None:
        """A queued job the cluster shrank under waits `queue_shrink_grace_s` for nodes to return,
        then fails."""
        for jid in list(self._too_big_since):
            if jid not in decision.too_big:
                del self._too_big_since[jid]
        grace = self.settings.queue_shrink_grace_s
        for jid in decision.too_big:
            since = self._too_big_since.setdefault(jid, now)
            if now - since >= grace:
                why = decision.waiting[jid][1]
                await self._end(jid, JobState.FAILED, f"{why}; no node came back within {grace:g}s")

    def _submission_ended(self, job_id: str, task: asyncio.Task[None]) -> None:
        self._submitting.pop(job_id, None)
        if not task.cancelled() and isinstance(e := task.exception(), Deposed):
            log.warning("job %s: submission abandoned: %s", job_id, e)
        elif not task.cancelled() and (e := task.exception()) is not None:  # e.g. the store is down
            log.error(
                "job %s: submission failed (%s); the scheduler tries again", job_id, e, exc_info=e
            )

    async def _submit(self, job_id: str, spec: JobSpec, attempt: int, restarts: int = 0) -> None:
        try:
            found = await self._with_retries(self._try_find, job_id, attempt)
        except _SubmitGaveUp as e:
            await asyncio.to_thread(self.store.jobs.transition, job_id, JobState.FAILED, str(e))
            return
        if found is not None:  # submitted by a leader that died before recording it
            log.warning("job %s: adopting driver %s, submitted before a takeover", job_id, found)
            await self._submitted(job_id, found)
            return
        token = secrets.token_urlsafe(32)
        await asyncio.to_thread(self._rotate_token, job_id, token)
        delivered = self.store.metrics.delivered_through
        through = await asyncio.to_thread(delivered, job_id, spec.world_size) if attempt else 0
        req = LaunchRequest(
            job_id=job_id,
            spec=spec,
            control_url=self.settings.control_url,
            ingest_token=token,
            checkpoint_dir=self.settings.checkpoint_dir,
            attempt=attempt,
            placement_timeout_s=self.settings.placement_timeout_s,
            restarts=restarts,
            delivered_through=through,
        )
        try:
            sid = await self._with_retries(self._try_submit, req)
        except _SubmitGaveUp as e:
            await asyncio.to_thread(self.store.jobs.transition, job_id, JobState.FAILED, str(e))
            return
        if sid is None:
            return
        await self._submitted(job_id, sid)

    async def _submitted(self, job_id: str, sid: str) -> None:
        """Record the driver's submission; PLACING, unless the job was cancelled meanwhile."""
        job = await asyncio.to_thread(self.store.jobs.set_submission, job_id, sid)
        log.info("job %s: driver submitted as %s", job_id, sid)
        if job.cancel_requested or JobState(job.state).terminal:
            await asyncio.to_thread(self.launcher.stop, sid)
            return
        await asyncio.to_thread(
            self.store.jobs.transition,
            job_id,
            JobState.PLACING,
            self.launcher.submitted.format(sid=sid),
            only_from={JobState.QUEUED},
        )

    async def _with_retries(
        self, fn: Callable[..., Awaitable[str | None]], *args: object
    ) -> str | None:
        """`fn(*args)` (`_try_find`, `_try_submit`); its refusals are retried after 2, 4, 8... s (at
        most 30 s) until `submit_attempts` failed tries are counted in the store (so a restarted
        control plane does not start over)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_SubmitRefused),
            wait=wait_exponential(multiplier=2, max=30),
            reraise=True,
        )
        return await retrying(fn, *args)

    async def _try_find(self, job_id: str, attempt: int) -> str | None:
        """This attempt's driver if the cluster already runs it (None: it does not). A look-up that
        fails is a failed try, retried: a new ingest token minted without knowing would replace the
        one such a driver holds, and its submission would come back "already exists", i.e. as
        success, leaving that driver's every report a 401."""
        if not self._acting():
            raise Deposed(f"job {job_id}: this replica no longer leads; not looking it up")
        try:
            return await asyncio.to_thread(self.launcher.find, job_id, attempt)
        except Exception as e:  # the cluster unreachable, for now
            n = await asyncio.to_thread(self.store.jobs.record_submit_failure, job_id)
            msg = (
                f"cannot look for an earlier submission of the driver on Ray: "
                f"{type(e).__name__}: {e}"
            )
            log.warning("job %s: %s (try %d of %d)", job_id, msg, n, self.settings.submit_attempts)
            if n >= self.settings.submit_attempts:
                raise _SubmitGaveUp(f"{msg} (gave up after {n} tries)") from e
            raise _SubmitRefused(msg) from e

    async def _try_submit(self, req: LaunchRequest) -> str | None:
        """The submission id; None when the job was cancelled meanwhile."""
        job = await asyncio.to_thread(self.store.jobs.get, req.job_id)
        if job.cancel_requested or JobState(job.state).terminal:
            return None
        if not self._acting():
            raise Deposed(f"job {req.job_id}: this replica no longer leads; not submitting")
        try:
            return await asyncio.to_thread(self.launcher.submit, req)
        except Exception as e:  # Ray unreachable, rejected entrypoint, ...
            n = await asyncio.to_thread(self.store.jobs.record_submit_failure, req.job_id)
            msg = f"could not submit the driver to Ray: {type(e).__name__}: {e}"
            log.warning(
                "job %s: %s (try %d of %d)", req.job_id, msg, n, self.settings.submit_attempts
            )
            if n >= self.settings.submit_attempts:
                raise _SubmitGaveUp(f"{msg} (gave up after {n} tries)") from e
            raise _SubmitRefused(msg) from e

    def _rotate_token(self, job_id: str, token: str) -> None:
        self.store.tokens.replace(job_id, hash_token(token))

    # ---- cancel ---------------------------------------------------------------------------------
    async def cancel(self, job_id: str, owner: str | None) -> None:
        await asyncio.to_thread(self.store.jobs.get, job_id, owner)  # raises JobNotFound
        job = await asyncio.to_thread(self.store.jobs.request_cancel, job_id)
        if job.submission_id and not JobState(job.state).terminal:
            try:
                await asyncio.to_thread(self.launcher.stop, job.submission_id)
            except Exception as e:
                log.warning("job %s: stop failed (%s); the reconciler will retry", job_id, e)

    # ---- reconciliation -------------------------------------------------------------------------
    async def reconcile_once(self) -> None:
        now = time.time()
        active = await asyncio.to_thread(self.store.jobs.active)
        alive = {j.id for j in active}
        for jid in list(self._ended_seen):
            if jid not in alive:
                del self._ended_seen[jid]
        for job in active:
            if job.submission_id is None:
                continue
            try:
                info = await asyncio.to_thread(self.launcher.status, job.submission_id)
            except Exception as e:
                log.warning("job %s: cannot read driver status (%s)", job.id, e)
                continue
            if (
                job.cancel_requested
                and job.cancel_requested_at
                and now - job.cancel_requested_at > self.settings.cancel_grace_s
            ):
                await self._end(
                    job.id,
                    JobState.CANCELLED,
                    "cancel requested; the driver did not confirm within "
                    f"{self.settings.cancel_grace_s:g}s (Ray status {info.status})",
                )
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.launcher.stop, job.submission_id)
                continue
            if not info.status.finished:
                self._ended_seen.pop(job.id, None)
                if info.status == DriverStatus.PREEMPTED and not job.cancel_requested:
                    await self._preempted(job, info.message)
                continue
            first = self._ended_seen.setdefault(job.id, now)
            if now - first < self.settings.reconcile_grace_s:
                continue
            first_line = (
                (info.message or "").strip().splitlines()[:1]
            )  # Ray appends up to 20 kB of driver log
            detail = f": {first_line[0][:500]}" if first_line else ""
            if job.cancel_requested:
                await self._end(
                    job.id,
                    JobState.CANCELLED,
                    f"cancelled; driver ended (Ray status {info.status})",
                )
            elif info.status == DriverStatus.UNKNOWN:
                # The Ray head was replaced (a restarted `ringtrain serve` starts a fresh private
                # head) or the job expired there: the checkpoints are still on disk, so the job
                # continues from them.
                reason = (
                    f"Ray does not know driver {job.submission_id} "
                    "(the cluster was replaced or the job expired)"
                )
                if not await self._resubmit(job.id, job.submission_id, reason, counts=False):
                    await self._end(job.id, JobState.FAILED, reason + detail)
            else:
                reason = (
                    "the driver ended without reporting a final state "
                    f"(Ray status {info.status}{detail})"
                )
                if (
                    info.status == DriverStatus.FAILED
                ):  # crashed or killed: its checkpoints are still there
                    if await self._resubmit(job.id, job.submission_id, reason):
                        continue
                    max_restarts = int(
                        (job.spec or {}).get("max_restarts", 0)
                    )  # no re-validation: files may be gone
                    reason += f"; no restarts left (max_restarts {max_restarts})"
                await self._end(job.id, JobState.FAILED, reason)

    async def _preempted(self, job: Job, why: str) -> None:
        """The queue in front of the cluster (Kueue) took a started driver's resources back; the
        submission stays. Re-admitted, it starts this attempt's driver again (same ingest token),
        which resumes from the last checkpoint and reports PLACING/RUNNING (allowed from RETRYING):
        no restart used, nothing resubmitted."""
        live = {JobState.PLACING, JobState.RUNNING}
        if JobState(job.state) not in live:
            return
        reason = f"{why}; waits to be admitted again, then resumes from the last checkpoint"
        try:
            moved = await asyncio.to_thread(
                self.store.jobs.transition, job.id, JobState.RETRYING, reason, only_from=live
            )
        except (JobNotFound, StoreError) as e:
            log.warning("job %s: could not record the preemption (%s)", job.id, e)
            return
        if moved:
            log.warning("job %s: %s", job.id, reason)

    async def _resubmit(
        self, job_id: str, submission_id: str, reason: str, *, counts: bool = True
    ) -> bool:
        """A lost driver is a lost rank of a bigger kind: while restarts remain, RETRYING and a new
        driver (next attempt) that resumes from the job's last checkpoint; it reports the step it
        resumes from."""
        try:
            retry = self.store.jobs.retry_driver
            ok = await asyncio.to_thread(retry, job_id, submission_id, reason, counts=counts)
        except (JobNotFound, StoreError) as e:
            log.warning("job %s: could not resubmit (%s)", job_id, e)
            return True  # try again on the next pass
        if ok:
            log.warning("job %s: %s; resubmitting the driver", job_id, reason)
            self._ended_seen.pop(job_id, None)
            self.wake()
        return ok

    async def _end(self, job_id: str, to: JobState, reason: str) -> None:
        try:
            done = await asyncio.to_thread(self.store.jobs.transition, job_id, to, reason)
        except (JobNotFound, StoreError) as e:
            log.warning("job %s: could not end (%s)", job_id, e)
            return
        if done:
            log.info("job %s: %s (%s)", job_id, to, reason)
        self._ended_seen.pop(job_id, None)
