"""The spec's sections other than the model: data, parallel shape, training, checkpoints, evals,
verification and resources."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, WithJsonSchema, field_serializer, field_validator

from workers.config.base import MAX_MLP_TILES, MAX_SEQ_LEN, MAX_WORLD, Layout, StrictModel
from workers.config.knobs import Checkpointing, MemoryKnobs
from workers.parallel_dims import ParallelDims


class CurriculumStage(StrictModel):
    """A curriculum stage: `steps` steps on contexts of `seq_len` tokens, before data.seq_len."""

    steps: int = Field(..., ge=1, le=10_000_000)
    seq_len: int = Field(..., ge=64, le=MAX_SEQ_LEN)


class PasskeyData(StrictModel):
    """Synthetic retrieval: a random key hidden at `depth` in filler text, asked for at the end."""

    kind: Literal["passkey"] = "passkey"
    seq_len: int = Field(4096, ge=64, le=MAX_SEQ_LEN)
    depth: float | None = Field(
        None, ge=0.0, le=1.0, description="where the key sits; None = random per sample"
    )
    key_digits: int = Field(5, ge=1, le=20)
    answer_weight: float = Field(
        1.0, ge=0.0, le=1e4, description="extra loss weight on the answer tokens"
    )
    curriculum: list[CurriculumStage] = Field(
        default_factory=list,
        max_length=32,
        description="shorter contexts first: stages trained in order, then data.seq_len for the "
        "remaining steps",
    )


class TextData(StrictModel):
    """A local corpus (.txt, .jsonl, .parquet) made into seq_len sequences (`pack`), byte-level
    tokens by default."""

    kind: Literal["text"] = "text"
    seq_len: int = Field(4096, ge=16, le=MAX_SEQ_LEN)
    path: str = Field(..., min_length=1, max_length=4096)
    text_field: str = Field(
        "text", min_length=1, max_length=256, description="field read from .jsonl/.parquet"
    )
    pack: Literal["windows", "documents"] = Field(
        "windows",
        description="windows: the corpus as one token stream cut into seq_len windows; "
        "documents: whole documents packed into each sequence, positions restarting per document, "
        "no attention across documents",
    )

    @field_validator("path", "text_field")
    @classmethod
    def _printable(cls, v: str) -> str:
        # a NUL or other control character is never part of a real file or field name, and
        # os/pathlib functions raise ValueError on NUL instead of answering
        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        return v


class TokensData(StrictModel):
    """A prepared dataset directory (`ringtrain data prepare`): token shards read through memory
    maps."""

    kind: Literal["tokens"] = "tokens"
    seq_len: int = Field(4096, ge=16, le=MAX_SEQ_LEN)
    path: str = Field(
        ..., min_length=1, max_length=4096, description="the directory `data prepare --out` wrote"
    )
    pack: Literal["documents", "windows"] = Field(
        "documents",
        description="documents: whole documents packed into each sequence, positions restarting "
        "per document, no attention across documents; windows: the documents as one stream cut "
        "into seq_len windows",
    )
    validation: float | str = Field(
        0.0,
        description="share of documents of `path` held out for val_loss at every eval (0 to 0.5; "
        "0: none), or a prepared dataset directory of held-out documents (same tokenizer)",
    )

    @field_validator("path")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v.isprintable():
            raise ValueError("must not contain control or other non-printable characters")
        return v

    @field_validator("validation", mode="before")
    @classmethod
    def _share_or_path(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError("must be a share of documents (0 to 0.5) or a dataset directory")
        if isinstance(v, str):
            text = v
            try:  # PyYAML reads 1e-2 as text: a number is a share, not a path
                v = float(text)
            except ValueError:
                if not text or len(text) > 4096 or not text.isprintable():
                    raise ValueError(
                        "a dataset directory: 1 to 4096 printable characters"
                    ) from None
                return text
        if isinstance(v, int | float) and not 0.0 <= v <= 0.5:
            raise ValueError("a share of documents must be between 0 and 0.5")
        return v


DataConfig = Annotated[PasskeyData | TextData | TokensData, Field(discriminator="kind")]


AUTO_RING = 0
"""`parallel.ring_size: auto` until it is resolved (`service.planner.fit`, at submission): the
smallest ring whose memory estimate fits the devices. A stored job never holds it."""


PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "zero_bubble"]


class ParallelConfig(StrictModel):
    ring_size: Annotated[
        int,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "integer", "minimum": 1, "maximum": MAX_WORLD},
                    {"const": "auto"},
                ]
            }
        ),
    ] = Field(
        1,
        ge=AUTO_RING,
        le=MAX_WORLD,
        description="ranks of the ring, or auto: the smallest that fits the devices' memory "
        "(resolved at submission, with the memory knobs)",
    )
    data_parallel: int = Field(1, ge=1, le=MAX_WORLD)
    layout: Layout = "zigzag"
    ulysses_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD,
        description="Ulysses x ring: ranks of one node that trade sequence for heads by all-to-all "
        "around the ring",
    )
    tensor_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD,
        description="tensor parallel: ranks of one node that split every block's heads and MLP "
        "columns; each runs the ring over its own heads",
    )

    pipeline_size: int = Field(
        1,
        ge=1,
        le=MAX_WORLD,
        description="pipeline parallel: stages the model's layers are split into, the outermost "
        "mesh dimension (pp x dp x ring x ulysses x tp)",
    )
    pipeline_schedule: PipelineSchedule = Field(
        "1f1b",
        description="1f1b: one stage per pipeline rank; interleaved_1f1b and zero_bubble: two "
        "virtual stages per rank (torch.distributed.pipelining's schedules)",
    )
    pipeline_split: (
        Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=MAX_WORLD)]
        | Literal["auto"]
        | None
    ) = Field(
        None,
        description="layers per stage, in order (one entry per stage: pipeline_size x virtual "
        "stages), or auto: the planner balances the stages by its memory estimate (the first "
        "stage carries the embedding, the last the head and the loss; resolved at submission); "
        "default: an even split",
    )

    auto_fields: ClassVar[frozenset[str]] = frozenset({"ring_size"})

    @field_validator("ring_size", mode="before")
    @classmethod
    def _ring_auto(cls, v: Any) -> Any:
        """ "auto" is kept as AUTO_RING (an int, so every reader of a resolved spec stays typed)."""
        if v == "auto":
            return AUTO_RING
        if isinstance(v, int) and not isinstance(v, bool) and v == AUTO_RING:
            raise ValueError("ring_size must be >= 1 or auto")
        return v

    @field_validator("pipeline_split", mode="before")
    @classmethod
    def _split_shape(cls, v: Any) -> Any:
        """One error at `parallel.pipeline_split` for anything but auto, null or a list of two
        or more layer counts >= 1 (the union would otherwise report each of its branches)."""
        if v is None or v == "auto":
            return v
        ok = isinstance(v, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v
        )
        if not ok or not 2 <= len(v) <= MAX_WORLD:
            raise ValueError(
                f"pipeline_split must be auto or a list of 2 to {MAX_WORLD} layer counts >= 1 "
                f"(one per stage), got {v!r}"
            )
        return v

    @field_serializer("ring_size")
    def _ring_dump(self, v: int) -> int | str:
        return "auto" if v == AUTO_RING else v

    @property
    def ring_auto(self) -> bool:
        return self.ring_size == AUTO_RING

    @property
    def world_size(self) -> int:
        return ParallelDims.of(self).world_size

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pipeline rank: 2 for the interleaved schedules, else 1."""
        return 1 if self.pipeline_schedule == "1f1b" else 2

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages in all (1 without pipeline parallelism)."""
        return self.pipeline_size * self.virtual_stages if self.pipeline_size > 1 else 1


class TrainConfig(StrictModel):
    steps: int = Field(100, ge=1, le=10_000_000)
    batch_size: int = Field(1, ge=1, le=65536, description="global sequences per step")
    lr: float = Field(3e-4, gt=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    weight_decay: float = Field(0.1, ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="0 disables clipping")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    microbatches: int = Field(
        1,
        ge=1,
        le=65536,
        description="pipeline parallel: the global batch runs as this many microbatches "
        "(>= parallel.pipeline_size); 1 without a pipeline",
    )
    activation_checkpointing: Checkpointing = Field(
        "none",
        description="recompute in backward: none, selective (each MLP), full (each block); "
        "true = full",
    )
    tiled_mlp: Literal["off", "auto"] | int = Field(
        "off",
        description="run each MLP over N sequence tiles (auto: N from the local length); "
        "off = 1 tile",
    )
    offload_activations: bool = Field(
        False, description="CUDA: checkpointed block inputs in pinned host memory until backward"
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_bool(cls, v: Any) -> Any:
        """Older specs said true/false: they mean full/none."""
        if isinstance(v, bool):
            return "full" if v else "none"
        return v

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiles(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, int) and not 1 <= v <= MAX_MLP_TILES):
            raise ValueError(
                f"tiled_mlp must be off, auto or a tile count in [1, {MAX_MLP_TILES}], got {v!r}"
            )
        return v

    @property
    def knobs(self) -> MemoryKnobs:
        """The memory knobs as one value (`workers.config.knobs`)."""
        return MemoryKnobs(self.activation_checkpointing, self.tiled_mlp, self.offload_activations)


class CheckpointConfig(StrictModel):
    every_steps: int = Field(50, ge=0, le=10_000_000, description="0 disables periodic checkpoints")
    keep: int = Field(3, ge=1, le=1000)


EvalSuite = Literal["passkey", "val", "ruler"]


class EvalConfig(StrictModel):
    """What a job evaluates: `passkey` (the needle-in-a-haystack grid: accuracy per context length
    and depth), `val` (held-out loss, and loss by position, on a prepared dataset's held-out
    documents). By default the suite follows the data: passkey for passkey data, held-out loss
    otherwise, so no job shows a retrieval grid it was never trained for. `ruler` runs on an
    exported model (`ringtrain eval`), not inside a training job (yet)."""

    suites: list[EvalSuite] | None = Field(
        None, min_length=1, max_length=3, description="default: passkey for passkey data, else val"
    )
    every_steps: int = Field(0, ge=0, le=10_000_000, description="0 = only after the last step")
    context_lengths: list[int] | None = Field(
        None, max_length=32, description="default: [data.seq_len]"
    )
    depths: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 0.9], min_length=1, max_length=32
    )
    samples: int = Field(4, ge=1, le=1024, description="passkeys tried per grid cell")
    enabled: bool = True

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        for d in v:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"every depth must lie in [0, 1], got {d}")
        return v


class VerifyConfig(StrictModel):
    """The check every job runs before step 1: its distributed forward/backward against a
    one-rank reference (`workers.training.verify`)."""

    enabled: bool = True
    tokens: int = Field(
        256,
        ge=16,
        le=8192,
        description="tokens in the random check sequence (at most data.seq_len, fit to the layout)",
    )


class ResourcesConfig(StrictModel):
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    cpus_per_worker: float = Field(
        1.0, ge=1e-4, le=1024, description=">= 0.0001: Ray's resource granularity"
    )
