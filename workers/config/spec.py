"""`JobSpec`, the whole job, with its cross-field rules, and `load_spec` (YAML or JSON)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from workers.config.base import MAX_SEQ_LEN, MAX_WORLD, StrictModel, fail
from workers.config.elastic import ElasticConfig, elastic_problem
from workers.config.init_from import InitFrom
from workers.config.models import MODEL_CONFIGS, ModelConfig, ModelSection
from workers.config.rules import pipeline_problem, tensor_heads_problem, ulysses_heads_problem
from workers.config.sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ParallelConfig,
    PasskeyData,
    ResourcesConfig,
    TrainConfig,
    VerifyConfig,
)
from workers.config.stages import MAX_STAGES, Stage, StageConfig, plan, stage_at
from workers.parallel_dims import ParallelDims

RULER_MIN_LENGTH = 2048  # every RULER task's question and answers fit, in bytes


class JobSpec(StrictModel):
    name: str = Field(..., min_length=1, max_length=128)
    model: ModelSection = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=PasskeyData)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    max_restarts: int = Field(2, ge=0, le=100)
    priority: int = Field(
        0, ge=-1000, le=1000, description="higher starts first when jobs wait for capacity"
    )
    init_from: InitFrom | None = Field(
        None, description="start from another job's checkpoint: weights, or the full state"
    )
    stages: list[StageConfig] | None = Field(
        None,
        min_length=1,
        max_length=MAX_STAGES,
        description="context extension in one job: each stage's steps and overrides",
    )
    elastic: ElasticConfig = Field(
        default_factory=ElasticConfig,
        description="on rank loss, shrink onto what can be placed now; grow back later",
    )

    @model_validator(mode="before")
    @classmethod
    def _steps_of_stages(cls, data: Any) -> Any:
        """With stages, train.steps is their sum: filled in when omitted, refused when not equal."""
        stages = data.get("stages") if isinstance(data, dict) else None
        if not isinstance(stages, list) or not stages:
            return data
        steps = [s.get("steps") if isinstance(s, dict) else None for s in stages]
        counts = [n for n in steps if isinstance(n, int) and not isinstance(n, bool) and n > 0]
        if len(counts) != len(steps):
            return data  # each stage's own error says which
        total = sum(counts)
        train = data.get("train")
        if train is None:
            train = {}
        if not isinstance(train, dict):
            return data
        if "steps" in train and train["steps"] != total:
            fail(
                "train.steps",
                train["steps"],
                f"train.steps ({train['steps']}) must be omitted or equal the stages' steps "
                f"summed ({total})",
            )
        return {**data, "train": {**train, "steps": total}}

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # isprintable(), not just `ord(c) < 32`: DEL, C1 controls (e.g. a terminal's CSI), bidi
        # overrides and lone surrogates must not reach terminals, logs and the dashboard either
        if not v.strip() or not v.isprintable():
            raise ValueError("name must be printable (no control characters) and not blank")
        return v

    @field_validator("model", mode="wrap")
    @classmethod
    def _model_kind(cls, v: Any, handler: Any, info: Any) -> ModelSection:
        """`kind` picks the class (native when absent) so errors stay at `model.<field>`, with no
        union tag."""
        if isinstance(v, dict):
            kind = v.get("kind", "native")
            model_cls = MODEL_CONFIGS.get(kind) if isinstance(kind, str) else None
            if model_cls is not None:
                return model_cls.model_validate(v, context=info.context)
            known = " or ".join(repr(k) for k in MODEL_CONFIGS)
            fail("kind", kind, f"model.kind must be {known}, got {kind!r}")
        if isinstance(v, ModelSection):
            return v
        raise PydanticCustomError(
            "dict_type", "Input should be a valid dictionary (the model section)"
        )

    @model_validator(mode="after")
    def _model_fits(self) -> JobSpec:
        """Each model kind's own rules about the rest of the job (a pretrained sliding window)."""
        for path, value, message in self.model.spec_problems(self):
            fail(path, value, message)
        return self

    @model_validator(mode="after")
    def _cross_fields(self) -> JobSpec:
        p = self.parallel
        # ring_size auto: checked as ring 1 here (what every ring needs), in full once resolved
        ring = max(p.ring_size, 1)
        need = ParallelDims(1, ring, p.ulysses_size, p.tensor_size).seq_divisor(p.layout)
        if self.data.seq_len % need:
            fail(
                "data.seq_len",
                self.data.seq_len,
                f"data.seq_len ({self.data.seq_len}) must be divisible by {need} for the "
                f"{p.layout} layout with parallel.ring_size={ring}"
                + (f" and parallel.ulysses_size={p.ulysses_size}" if p.ulysses_size > 1 else "")
                + (f" and parallel.tensor_size={p.tensor_size}" if p.tensor_size > 1 else ""),
            )
        if self.model.shape_known and (why := tensor_heads_problem(self.model, p.tensor_size)):
            fail("parallel.tensor_size", p.tensor_size, why)
        if self.model.shape_known and (
            why := ulysses_heads_problem(self.model, p.ulysses_size, p.tensor_size)
        ):
            fail("parallel.ulysses_size", p.ulysses_size, why)
        if self.train.batch_size % p.data_parallel:
            fail(
                "train.batch_size",
                self.train.batch_size,
                f"train.batch_size ({self.train.batch_size}) is the global batch and must be "
                f"divisible by parallel.data_parallel ({p.data_parallel})",
            )
        if p.data_parallel * ring * p.ulysses_size * p.tensor_size > MAX_WORLD:
            fail(
                "parallel.ring_size",
                p.ring_size,
                f"ring_size x data_parallel x ulysses_size x tensor_size must be <= {MAX_WORLD}",
            )
        if p.pipeline_size * p.data_parallel * ring * p.ulysses_size * p.tensor_size > MAX_WORLD:
            fail(
                "parallel.pipeline_size",
                p.pipeline_size,
                f"pipeline_size x ring_size x data_parallel x ulysses_size x tensor_size must be "
                f"<= {MAX_WORLD}",
            )
        if (problem := pipeline_problem(self)) is not None:
            fail(*problem)
        if (problem := elastic_problem(self)) is not None:
            fail(*problem)
        knobs_problem = self.train.knobs.problem(cuda=self.resources.accelerator != "cpu")
        if knobs_problem:
            fail(knobs_problem[0], True, knobs_problem[1])
        if self.train.warmup_steps > self.train.steps:
            fail(
                "train.warmup_steps",
                self.train.warmup_steps,
                "train.warmup_steps must be <= train.steps",
            )
        for i, length in enumerate(self.eval.context_lengths or []):
            if length < 64 or length > MAX_SEQ_LEN or length % need:
                fail(
                    f"eval.context_lengths.{i}",
                    length,
                    f"eval context length {length} must be in [64, {MAX_SEQ_LEN}] and divisible "
                    f"by {need}",
                )
        for i, suite in enumerate(self.eval.suites or []):
            if suite == "ruler":
                for j, length in enumerate(self.eval_context_lengths()):
                    if length < RULER_MIN_LENGTH:
                        where = f"eval.context_lengths.{j}" if self.eval.context_lengths else None
                        fail(
                            where or "data.seq_len",
                            length,
                            f"eval.suites: ruler asks every task at each eval length, which needs "
                            f"at least {RULER_MIN_LENGTH} tokens (got {length}); set "
                            "eval.context_lengths",
                        )
            if suite == "val" and self.data.kind == "passkey":
                fail(
                    f"eval.suites.{i}",
                    suite,
                    "eval.suites: val needs held-out documents (data kind tokens or text); "
                    "passkey data has none",
                )
        if self.data.kind == "passkey" and self.data.seq_len < 16 * self.data.key_digits:
            fail("data.seq_len", self.data.seq_len, "data.seq_len is too short to hide a passkey")
        if self.data.kind == "passkey":
            for i, stage in enumerate(self.data.curriculum):
                if (
                    stage.seq_len > self.data.seq_len
                    or stage.seq_len % need
                    or stage.seq_len < 16 * self.data.key_digits
                ):
                    fail(
                        f"data.curriculum.{i}.seq_len",
                        stage.seq_len,
                        f"curriculum seq_len {stage.seq_len} must be <= data.seq_len "
                        f"({self.data.seq_len}), >= 16 x key_digits and divisible by {need}",
                    )
        return self

    @model_validator(mode="after")
    def _stages_valid(self) -> JobSpec:
        """Every stage's effective spec obeys every rule above (errors at `stages.<i>.<field>`)."""
        if self.stages:
            plan(self)
        return self

    @property
    def world_size(self) -> int:
        """Ranks the job runs on: its largest stage's (what it must be able to place)."""
        return max(s.spec.parallel.world_size for s in self.stage_plan())

    def stage_plan(self) -> list[Stage]:
        """The stages as they run (`workers.config.stages`); one stage without `stages`."""
        return plan(self)

    def stage_at(self, step: int) -> Stage:
        """The stage that runs the step after `step`."""
        return stage_at(self.stage_plan(), step)

    def largest_stage(self) -> Stage:
        """The stage that needs the most: ranks first, then sequence length."""
        return max(
            self.stage_plan(),
            key=lambda s: (s.spec.parallel.world_size, s.spec.data.seq_len, -s.index),
        )

    def eval_suites(self) -> list[str]:
        """The suites this job runs at each eval: the spec's, or the one its data calls for."""
        if self.eval.suites is not None:
            return list(dict.fromkeys(self.eval.suites))
        return ["passkey"] if self.data.kind == "passkey" else ["val"]

    def eval_context_lengths(self) -> list[int]:
        return list(self.eval.context_lengths or [self.data.seq_len])


def load_spec(text: str) -> JobSpec:
    """Parse a YAML or JSON job spec (YAML is a superset of JSON). Aliases are refused (no YAML
    bombs), and so are duplicate keys."""
    import yaml

    class _NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("YAML aliases/anchors are not allowed in job specs")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r}: each field may appear once",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    data = yaml.load(text, Loader=_NoAliasLoader)
    if not isinstance(data, dict):
        raise ValueError("a job spec must be a mapping (YAML or JSON object)")
    return JobSpec.model_validate(data)
