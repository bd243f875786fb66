"""Meta-device models: built without memory, sharded, then each rank materialises and fills only its
shards.

`skeleton(spec)` builds the job's model (its kind's `construct` hook, `workers.models.registry`)
with every parameter on `meta` (buffers stay real: RoPE's `inv_freq` is computed in `__init__` and
is in no checkpoint). After `parallelize` has sharded it, `materialize` allocates the local shards
on the device and the kind's `load_shards` hook fills them:

- native (`llama.init_shards`): each parameter's full initial value is drawn from the seed exactly
  as `build_model` draws it and the rank keeps its slice, so the model is the same on any world;
- pretrained (`hf.load_pretrained_shards`): DCP's `HuggingFaceStorageReader` reads only the byte
  ranges of this rank's shards from the safetensors files.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from workers.config import JobSpec
from workers.models import RingModel, kind_for


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to `meta`; buffers keep their real values."""
    register = nn.Module.register_parameter

    def on_meta(
        self: nn.Module, name: str, param: nn.Parameter | None
    ) -> None:  # named as the method it replaces
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    # mypy rejects assigning to a method on purpose; swapping it for this block is the point
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(spec: JobSpec) -> RingModel:
    """The job's model with parameters on `meta`, without activation checkpointing (`parallelize`
    adds it)."""
    kind = kind_for(spec)
    with parameters_on_meta():
        model: RingModel = kind.construct(spec.model)
        return model


def materialize(model: nn.Module, spec: JobSpec, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and fill them (from the seed, or the pretrained
    files)."""
    kind = kind_for(spec)
    if not isinstance(model, kind.model_class):
        built = kind.model_class.__name__
        raise TypeError(f"model.kind {kind.name!r} trains a {built}, not a {type(model).__name__}")
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    tied = _tied_groups(model)
    model.to_empty(device=device)
    for names in tied:  # a plain (unsharded) model gets one new tensor per name: tie them again
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    kind.load_shards(model, spec.model, spec)


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied LM head and input embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
