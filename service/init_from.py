"""`init_from` at submission: resolve the source to a checkpoint directory and step the ranks can
load, or refuse naming the field (nothing is created).

A `job` must be one the caller may read (another owner's job is "not found", as everywhere);
its checkpoints are `<checkpoint root>/<job id>` (`artifacts.job_dir`). A `checkpoint` directory
must lie inside the data roots and not inside the checkpoint root, where every job's checkpoints
live: those are reached through `job`, which checks ownership. The step is the one asked for or
the latest complete one; the models must be able to share weights (`architecture_problem`, read
from the source job's stored spec; a bare directory carries no spec, so a mismatch there fails
when the ranks load it, naming the missing or misshapen tensor).
"""

from __future__ import annotations

from pathlib import Path

from service.artifacts import job_dir
from service.store import JobNotFound, Store
from workers.checkpoint_layout import list_steps
from workers.config import JobSpec, architecture_problem


class InitFromRefused(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def resolve_init_from(
    spec: JobSpec, owner: str | None, store: Store, checkpoint_root: str, data_roots: list[Path]
) -> JobSpec:
    """The spec with `init_from.checkpoint` (an absolute directory) and `init_from.step` filled."""
    src = spec.init_from
    if src is None:
        return spec
    ckpt_root = job_dir(checkpoint_root, "x").parent.resolve()
    if src.job is not None:
        try:
            source = store.jobs.get(src.job, owner)
        except JobNotFound:
            raise InitFromRefused(
                "init_from.job", f"init_from.job: no job {src.job} that you can read"
            ) from None
        problem = architecture_problem(JobSpec.model_validate(source.spec).model, spec.model)
        if problem:
            raise InitFromRefused("init_from.job", f"init_from.job {src.job}: {problem}")
        where, name = job_dir(checkpoint_root, src.job).resolve(), f"job {src.job}"
    else:
        assert src.checkpoint is not None
        where, name = Path(src.checkpoint).expanduser().resolve(), src.checkpoint
        if _inside(where, ckpt_root) or not any(_inside(where, r) for r in data_roots):
            raise InitFromRefused(
                "init_from.checkpoint",
                f"init_from.checkpoint {where} is not inside the data roots "
                f"({', '.join(str(r) for r in data_roots)}); a job's checkpoints are reached "
                "with init_from.job",
            )
    steps = list_steps(where)
    if not steps:
        raise InitFromRefused(
            f"init_from.{'job' if src.job else 'checkpoint'}",
            f"init_from: {name} has no complete checkpoint yet (looked in {where})",
        )
    if src.step is not None and src.step not in steps:
        raise InitFromRefused(
            "init_from.step",
            f"init_from.step {src.step}: {name} has checkpoints at steps "
            f"{', '.join(map(str, steps))}",
        )
    step = src.step or steps[-1]
    if src.state == "full" and step >= spec.train.steps:
        raise InitFromRefused(
            "init_from.state",
            f"init_from.state full continues from step {step}, but train.steps is "
            f"{spec.train.steps}: give more steps than that, or state: weights",
        )
    resolved = src.model_copy(update={"checkpoint": str(where), "step": step})
    return spec.model_copy(update={"init_from": resolved})
