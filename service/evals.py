"""Evaluations on the cluster: `ringtrain eval` as a resource behind `/v1/evals`, run like a
prepared dataset's prepare (`service.datasets`).

`POST /v1/evals` names a model directory inside the data roots, or a job of the caller's whose
exported model (`<checkpoint dir>/<job>/model/`) exists. `EvalService.create` stores a row QUEUED
(`store.evals`) and starts `python -m workers.evals MODEL --lengths ... --samples N --seed S` as a
one-off task through the launcher (`Launcher.run_task`: a Ray job on the shared cluster, a RayJob of
its own in Kueue mode); a ring of R > 1 is `python -m torch.distributed.run --standalone
--nproc-per-node=R -m workers.evals ...`, asking for R CPUs. The control plane never imports the
evaluation code: it reads what the evaluation prints, one `[eval] ...` line per sample on stderr
and the report `{tasks, by_length, effective_length, threshold}` as the last JSON line on stdout.
Reads refresh unfinished rows from the task's status and log, so no background loop is needed and
any replica can serve them. States: QUEUED -> RUNNING -> SUCCEEDED | FAILED.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from service import tasks
from service.artifacts import model_dir
from service.launcher import Launcher, TaskRequest
from service.models import EvalRow
from service.store.errors import JobNotFound
from service.store.evals import Evals
from service.store.jobs import Jobs
from service.tasks import TERMINAL
from workers.config import MAX_SEQ_LEN

EVAL_MODULE = "workers.evals"
# workers.evals.ruler.TASKS, named here because the control plane does not import the evaluation
# code (tests/unit/service/test_evals.py keeps the two equal)
RulerTask = Literal[
    "niah_single_noise",
    "niah_single_essay",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
]
RULER_TASKS: tuple[str, ...] = get_args(RulerTask)
# Below this no task's question and answer fit (the shortest, a needle in noise, needs ~350 bytes).
MIN_LENGTH = 256
# Every task fits from here on, whatever the tokenizer (workers.config.spec.RULER_MIN_LENGTH, the
# floor of a training job's RULER evals): the whole suite at a shorter length would fail later.
ALL_TASKS_MIN_LENGTH = 2048
MAX_RING = 64  # one node's processes: the ring is torchrun's --standalone
MAX_SAMPLES = 10_000

Length = Annotated[int, Field(ge=MIN_LENGTH, le=MAX_SEQ_LEN)]


class EvalCreate(BaseModel):
    """The body of `POST /v1/evals` (exactly one of `model` and `job`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, min_length=1, max_length=4096, description="a model directory inside the data roots"
    )
    job: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="a job of yours whose exported model to evaluate",
    )
    suite: Literal["ruler"] = "ruler"
    lengths: list[Length] = Field(
        ..., min_length=1, max_length=32, description="prompt lengths in tokens"
    )
    samples: int = Field(4, ge=1, le=MAX_SAMPLES, description="samples per task and length")
    ring_size: int = Field(1, ge=1, le=MAX_RING, description="processes the prompt spans")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    tasks: list[RulerTask] | None = Field(
        None, min_length=1, max_length=len(RULER_TASKS), description="default: every task"
    )


class EvalRefused(ValueError):
    """A request refused before anything is stored: `status` (404 or 422) and the field."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.field, self.message = status, field, message


@dataclass(frozen=True)
class EvalRequest:
    """An accepted request: `model` is the directory the cluster reads (for `job`: its export)."""

    model: str
    job: str | None
    lengths: tuple[int, ...]
    samples: int
    ring_size: int = 1
    seed: int = 0
    tasks: tuple[str, ...] | None = None
    suite: str = "ruler"

    def args(self) -> tuple[str, ...]:
        """`python -m workers.evals`'s arguments for this request."""
        lengths = ",".join(str(n) for n in self.lengths)
        tasks = ("--tasks", ",".join(self.tasks)) if self.tasks else ()
        return (
            self.model,
            *("--lengths", lengths, "--samples", str(self.samples), "--seed", str(self.seed)),
            *tasks,
        )

    def task(self, eval_id: str) -> TaskRequest:
        """The cluster task that runs eval `eval_id`: the evaluation itself, or torchrun starting
        a ring of `ring_size` of them (rank 0 prints)."""
        module, args = EVAL_MODULE, self.args()
        if self.ring_size > 1:
            ring = ("--standalone", f"--nproc-per-node={self.ring_size}", "-m", EVAL_MODULE)
            module, args = "torch.distributed.run", (*ring, *args)
        return TaskRequest(
            task_id=f"eval-{eval_id}",
            module=module,
            args=args,
            cpus=float(self.ring_size),
            metadata={"ringtrain_eval_id": eval_id},
        )

    def total_samples(self) -> int:
        return len(self.tasks or RULER_TASKS) * len(self.lengths) * self.samples

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "job": self.job,
            "suite": self.suite,
            "lengths": list(self.lengths),
            "samples": self.samples,
            "ring_size": self.ring_size,
            "seed": self.seed,
            "tasks": list(self.tasks) if self.tasks else None,
        }


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


def parse_log(text: str) -> tuple[int, dict[str, Any] | None, str | None]:
    """(samples done, the final report, what went wrong) from an evaluation's output: `[eval]`
    lines count samples, the report is the last JSON object with `tasks` and `by_length`, and the
    error is the evaluation's own `error: ...` line, else the last exception line."""
    done, report, error, exception = 0, None, None, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[eval] "):
            done += 1
        elif line.startswith("error: "):
            error = line[len("error: ") :]
        elif _EXCEPTION.match(line):
            exception = line
        elif line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and {"tasks", "by_length"} <= set(obj):
                report = obj
    return done, report, error or (exception[:500] if exception else None)


def _inside(path: str, roots: list[Path]) -> Path:
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise EvalRefused(422, "model", f"model cannot be resolved: {e}") from e
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise EvalRefused(
            422,
            "model",
            f"model {resolved} is outside the allowed data roots ({allowed}); "
            "set RINGTRAIN_DATA_ROOTS to allow it",
        )
    return resolved


class EvalService:
    """The evaluations behind `/v1/evals`: rows in `store.evals`, tasks through the launcher's
    protocol only (whatever runs them: a shared Ray cluster or Kueue's RayJobs)."""

    def __init__(
        self,
        evals: Evals,
        jobs: Jobs,
        launcher: Launcher,
        data_roots: list[Path],
        checkpoint_dir: str,
    ) -> None:
        self.evals, self.jobs, self.launcher = evals, jobs, launcher
        self.data_roots, self.checkpoint_dir = data_roots, checkpoint_dir

    def accept(self, owner: str, body: EvalCreate) -> EvalRequest:
        """The request to run, or `EvalRefused` naming the field: what could only fail later is
        refused now."""
        if (body.model is None) == (body.job is None):
            raise EvalRefused(
                422, "model", "give exactly one of model (a model directory) and job (a job id)"
            )
        if body.tasks is None:
            for i, n in enumerate(body.lengths):
                if n < ALL_TASKS_MIN_LENGTH:
                    raise EvalRefused(
                        422,
                        f"lengths.{i}",
                        f"length {n}: every task's question and answers fit from "
                        f"{ALL_TASKS_MIN_LENGTH} tokens; name the tasks to run shorter prompts",
                    )
        if body.model is not None:
            model = _inside(body.model, self.data_roots)
        else:
            assert body.job is not None
            try:
                job = self.jobs.get(body.job, owner)
            except JobNotFound:
                raise EvalRefused(404, "job", f"no job {body.job}") from None
            model = model_dir(self.checkpoint_dir, body.job)
            if not model.is_dir():
                raise EvalRefused(
                    422,
                    "job",
                    f"job {body.job} ({job.state}) has no exported model at {model} yet: a job "
                    "exports its model when it succeeds",
                )
        return EvalRequest(
            model=str(model),
            job=body.job,
            lengths=tuple(sorted(set(body.lengths))),
            samples=body.samples,
            ring_size=body.ring_size,
            seed=body.seed,
            tasks=tuple(dict.fromkeys(body.tasks)) if body.tasks else None,
            suite=body.suite,
        )

    def create(self, owner: str, body: EvalCreate) -> dict[str, Any]:
        """Store the row and start its task; a failed start leaves a FAILED row saying why.
        Raises `EvalRefused` (nothing stored) for a request that cannot run."""
        req = self.accept(owner, body)
        now = time.time()
        eval_id = "e" + secrets.token_hex(6)
        task = req.task(eval_id)
        self.evals.add(
            EvalRow(
                id=eval_id,
                owner=owner,
                state="QUEUED",
                request=req.as_json(),
                submission_id=task.submission_id,
                progress={"samples_done": 0, "samples_total": req.total_samples()},
                created_at=now,
                updated_at=now,
            )
        )
        tasks.start(self.launcher, task, lambda **f: self.evals.update(eval_id, **f), "evaluation")
        found = self.get(eval_id, owner)
        assert found is not None
        return found

    def refresh(self, eval_id: str) -> None:
        """Bring an unfinished row up to date from its task's status and output."""
        row = self.evals.get(eval_id)
        if row is None or row.state in TERMINAL or row.submission_id is None:
            return
        sid = row.submission_id
        try:
            info = self.launcher.status(sid)
            log = self.launcher.logs(sid)
        except Exception:  # the cluster is unreachable now: the row stays as it was
            return
        done, report, error = parse_log(log)
        fields: dict[str, Any] = {}
        total = (row.progress or {}).get("samples_total")
        if done:
            fields["progress"] = {"samples_done": done, "samples_total": total}
        fields.update(tasks.outcome(info, report, error, "evaluation", "run it again"))
        if any(getattr(row, k) != v for k, v in fields.items()):  # a write only for news
            self.evals.update(eval_id, **fields)

    def get(self, eval_id: str, owner: str) -> dict[str, Any] | None:
        self.refresh(eval_id)
        row = self.evals.get(eval_id)
        return None if row is None or row.owner != owner else as_dict(row)

    def list(self, owner: str, limit: int = 100) -> list[dict[str, Any]]:
        ids = self.evals.ids(owner, limit)
        for i in ids:
            self.refresh(i)
        return [as_dict(r) for r in self.evals.rows(ids)]


def as_dict(row: EvalRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "owner": row.owner,
        "state": row.state,
        **row.request,
        "progress": row.progress,
        "result": row.result,
        "error": row.error,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }
