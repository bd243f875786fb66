"""Stages: context extension in one job (`stages: [...]` on a job spec).

A stage is `steps` plus partial overrides of the job's sections: `data` (length, path, packing,
validation), `model` (RoPE only: the weights carry over, so size, kind and vocabulary cannot
change), `parallel` (a longer stage may need a larger ring; `ring_size: auto` is fitted per stage)
and `train` (learning rate, warmup, batch, memory knobs). Each stage runs as the job would with
its overrides applied: that effective spec (`Stage.spec`) is an ordinary stage-less `JobSpec`, so
every rule, the planner and the trainer see nothing new. Two things tie the stages together:

- steps are numbered across the job (stage 2 of 12 + 12 runs steps 13..24); the global batch of a
  step still depends only on the stage's data spec, the seed and the step;
- each stage starts from the previous stage's last checkpoint, the model and optimizer state
  resharded onto its own shape, with its own learning-rate schedule (`Stage.spec.train.steps` is
  the stage's length: warmup and decay happen within it) and a fresh data position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from workers.config.base import StrictModel

if TYPE_CHECKING:
    from workers.config.spec import JobSpec

# what a stage may change, per section (a section's other fields stay the job's)
MODEL_OVERRIDES = frozenset({"rope_scaling", "rope_theta", "max_position_embeddings"})
TRAIN_OVERRIDES = frozenset(
    {
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "batch_size",
        "weight_decay",
        "grad_clip",
        "activation_checkpointing",
        "tiled_mlp",
        "offload_activations",
    }
)
MAX_STAGES = 64


class StageConfig(StrictModel):
    """One stage as written in a spec; `JobSpec.stage_plan()` gives its effective spec."""

    name: str | None = Field(None, min_length=1, max_length=64)
    steps: int = Field(..., ge=1, le=10_000_000)
    data: dict[str, Any] = Field(default_factory=dict, description="overrides of `data`")
    model: dict[str, Any] = Field(
        default_factory=dict, description="rope_scaling, rope_theta, max_position_embeddings"
    )
    parallel: dict[str, Any] = Field(default_factory=dict, description="overrides of `parallel`")
    train: dict[str, Any] = Field(
        default_factory=dict, description="lr, warmup_steps, batch_size, memory knobs, ..."
    )

    @field_validator("name")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or not v.isprintable()):
            raise ValueError("a stage name must be printable and not blank")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _only(v, MODEL_OVERRIDES, "the weights carry over between stages")

    @field_validator("train")
    @classmethod
    def _train(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "steps" in v:
            _refuse("steps", "a stage's length is its own `steps`, not train.steps")
        if "seed" in v:
            _refuse("seed", "the seed is the job's: every stage draws from it")
        return _only(v, TRAIN_OVERRIDES, "the rest of `train` is the job's")


def _only(overrides: dict[str, Any], allowed: frozenset[str], why: str) -> dict[str, Any]:
    for key in overrides:
        if key not in allowed:
            _refuse(
                key,
                f"{key} cannot change between stages ({why}); a stage may set "
                + ", ".join(sorted(allowed)),
            )
    return overrides


def _refuse(key: str, message: str) -> None:
    err = PydanticCustomError("stage_override", message)
    raise ValidationError.from_exception_data(
        "StageConfig", [InitErrorDetails(type=err, loc=(key,), input=key)]
    )


@dataclass(frozen=True)
class Stage:
    """A stage as it runs: its steps across the job and its effective (stage-less) spec."""

    index: int
    name: str
    start_step: int  # steps done before it: it runs steps start_step + 1 .. end_step
    end_step: int
    spec: JobSpec

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step


def merge(base: dict[str, Any], i: int) -> dict[str, Any]:
    """The job's spec (as JSON) with stage `i`'s overrides applied: a stage-less spec of
    `steps` steps. A data override of another `kind` replaces the data section."""
    s = base["stages"][i]
    out = {k: v for k, v in base.items() if k != "stages"}
    for section in ("data", "model", "parallel", "train"):
        over = s.get(section) or {}
        if section == "data" and "kind" in over and over["kind"] != base["data"].get("kind"):
            out["data"] = dict(over)
        else:
            out[section] = {**base[section], **over}
    out["train"]["steps"] = s["steps"]
    if i > 0:
        out["init_from"] = None  # the first stage starts from it; later ones from their previous
    return out


def plan(spec: JobSpec) -> list[Stage]:
    """The job's stages; a job without `stages` is one stage of `train.steps` steps."""
    from workers.config.spec import JobSpec

    if not spec.stages:
        return [Stage(0, "", 0, spec.train.steps, spec)]
    base = spec.model_dump(mode="json")
    out: list[Stage] = []
    start = 0
    for i, s in enumerate(spec.stages):
        merged = merge(base, i)
        try:
            effective = JobSpec.model_validate(merged)
        except ValidationError as e:
            raise ValidationError.from_exception_data(
                "JobSpec",
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "stage_rule", "{message}", {"message": _message(err)}
                        ),
                        loc=("stages", i, *err["loc"]),
                        input=err.get("input"),
                    )
                    for err in e.errors()
                ],
            ) from None
        out.append(Stage(i, s.name or f"stage {i + 1}", start, start + s.steps, effective))
        start += s.steps
    return out


def _message(err: Any) -> str:
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that runs the step after `step` (a checkpoint at a stage's last step starts the
    next one); the last stage once the job is done."""
    for s in stages:
        if step < s.end_step:
            return s
    return stages[-1]


def with_overrides(spec: JobSpec, overrides: dict[int, dict[str, dict[str, Any]]]) -> JobSpec:
    """`spec` with more overrides written into some of its stages (`{index: {section: {field:
    value}}}`): how the control plane stores what it resolved per stage (`ring_size: auto`, the
    knobs that fit). A job's `parallel.ring_size: auto` becomes 1 once every stage has its own."""
    from workers.config.spec import JobSpec

    data = spec.model_dump(mode="json")
    for i, sections in overrides.items():
        stage = data["stages"][i]
        for section, fields in sections.items():
            stage[section] = {**(stage.get(section) or {}), **fields}
    if data["parallel"]["ring_size"] == "auto" and all(
        (s.get("parallel") or {}).get("ring_size", "auto") != "auto" for s in data["stages"]
    ):
        data["parallel"]["ring_size"] = 1
    return JobSpec.model_validate(data)
