"""The model registry: one `ModelKind` per `model.kind`, the one place that knows how kinds differ.

Every site that needs a kind's own behaviour looks its entry up here instead of branching on kind
strings or model classes: `model_for` (an unsharded model for tools and tests), the trainer's
meta-device `skeleton` and shard loading (`training/materialize.py`), `save_pretrained` (which gets
only the model, hence `kind_of`), `tokenizer_for` and the tensor-parallel plan
(`training/tensor_parallel.plan_for`). The spec side, kind -> pydantic config class, is
`workers.config.MODEL_CONFIGS`: the control plane validates and plans specs without torch, so it
cannot import this module (what it needs of a kind, such as sizes and `cpu_runtime_bytes`, is on the
config class); `register_model_kind` refuses an entry whose config class is not the one there.

A new kind takes: its config class in `workers/config/` (added to `ModelSection`), a module in
`workers/models/` with its `RingModel` subclass and hooks, and one `register_model_kind` call below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from pydantic import BaseModel
from torch import nn

from workers.config import MODEL_CONFIGS, HFModelConfig, JobSpec, ModelConfig
from workers.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from workers.models.base import RingModel
from workers.models.export import write_native, write_pretrained
from workers.models.hf import (
    PretrainedLM,
    build_pretrained,
    construct_pretrained,
    load_pretrained_shards,
    pretrained_tp_plan,
)
from workers.models.llama import Transformer, build_model, native_tp_plan
from workers.models.llama import init_shards as init_native_shards

C = TypeVar("C", bound=BaseModel)
M = TypeVar("M", bound=RingModel)


@dataclass(frozen=True)
class ModelKind(Generic[C, M]):
    """Everything ringtrain does differently for one model kind. Hooks get the spec's typed `model`
    section (`C`) and, where they need more (seed, checkpointing), the whole spec."""

    name: str  # the spec's `model.kind`
    config: type[C]  # the spec's `model` section for this kind (`workers.config`, torch-free)
    model_class: type[M]  # what `build` and `construct` return
    build: Callable[[C, JobSpec], M]  # unsharded, fp32 on CPU, weights in place, ready to run
    # the architecture alone (`skeleton` runs it with parameters on meta)
    construct: Callable[[C], M]
    # fill this rank's allocated (possibly sharded) parameters
    load_shards: Callable[[M, C, JobSpec], None]
    # the full state -> a transformers directory
    export: Callable[[M, dict[str, torch.Tensor], Path, int], None]
    tokenizer: Callable[[C], Tokenizer]  # what data and evals encode text with
    # per block: block-relative module name (fnmatch) -> style (`training/tensor_parallel.py`)
    tp_plan: Callable[[M], Mapping[str, str]]


_KINDS: dict[str, ModelKind[Any, Any]] = {}


def register_model_kind(kind: ModelKind[Any, Any]) -> None:
    """Add a kind. Its name must already map to its config class in `config.MODEL_CONFIGS`."""
    if kind.name in _KINDS:
        raise ValueError(f"model kind {kind.name!r} is registered already")
    if MODEL_CONFIGS.get(kind.name) is not kind.config:
        raise ValueError(
            f"model kind {kind.name!r}: workers.config.MODEL_CONFIGS must map it to "
            f"{kind.config.__name__} (add the class to ModelSection)"
        )
    _KINDS[kind.name] = kind


def registered_kinds() -> tuple[str, ...]:
    """Names of the registered kinds, in registration order."""
    return tuple(_KINDS)


def model_kind(name: str) -> ModelKind[Any, Any]:
    """The entry for `model.kind` = `name`."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown model kind {name!r}; registered: {', '.join(_KINDS)}") from None


def kind_for(spec: JobSpec) -> ModelKind[Any, Any]:
    """The entry for a job's model."""
    return model_kind(spec.model.kind)


def tokenizer_for(spec: JobSpec) -> Tokenizer:
    """The tokenizer a job's data and evals use: the model directory's own for `model.kind: hf`,
    bytes for native models. Callers hand it to the data layer (`workers.data.build_source`)."""
    return kind_for(spec).tokenizer(spec.model)


def kind_of(model: nn.Module) -> ModelKind[Any, Any]:
    """The entry whose `model_class` this model is (the most derived one: FSDP2 subclasses a sharded
    model's class, and a kind may subclass another's model)."""
    mro = type(model).__mro__
    matches = [k for k in _KINDS.values() if k.model_class in mro]
    if not matches:
        known = ", ".join(k.model_class.__name__ for k in _KINDS.values())
        raise TypeError(f"{type(model).__name__} is no registered model kind's model ({known})")
    return min(matches, key=lambda k: mro.index(k.model_class))


def _build_native(cfg: ModelConfig, spec: JobSpec) -> Transformer:
    return build_model(cfg, spec.train.seed)


def _byte_tokenizer(cfg: ModelConfig) -> Tokenizer:
    return ByteTokenizer()


def _pretrained_tokenizer(cfg: HFModelConfig) -> Tokenizer:
    return load_tokenizer(cfg.path)


register_model_kind(
    ModelKind(
        name="native",
        config=ModelConfig,
        model_class=Transformer,
        build=_build_native,
        construct=Transformer,
        load_shards=init_native_shards,
        export=write_native,
        tokenizer=_byte_tokenizer,
        tp_plan=native_tp_plan,
    )
)
register_model_kind(
    ModelKind(
        name="hf",
        config=HFModelConfig,
        model_class=PretrainedLM,
        build=build_pretrained,
        construct=construct_pretrained,
        load_shards=load_pretrained_shards,
        export=write_pretrained,
        tokenizer=_pretrained_tokenizer,
        tp_plan=pretrained_tp_plan,
    )
)

__all__ = [
    "ModelKind",
    "kind_for",
    "kind_of",
    "model_kind",
    "register_model_kind",
    "registered_kinds",
]
