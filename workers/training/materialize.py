"""Meta-device models: built without memory, sharded, then each rank materialises and fills only its shards.

`skeleton(spec)` builds the job's model with every parameter on `meta` (buffers stay real: RoPE's
`inv_freq` is computed in `__init__` and is in no checkpoint). After `parallelize` has sharded it,
`materialize` allocates the local shards on the device and fills them:

- native: each parameter's full initial value is drawn from the seed exactly as `build_model` draws it
  (`Transformer.init_value`, in `named_parameters` order) and the rank keeps its slice, so the model is
  the same on any world size — at the cost of one full parameter at a time in host memory;
- pretrained: the safetensors files are read through DCP's `HuggingFaceStorageReader`, which reads only
  the byte ranges of this rank's shards (dtype converted on the fly).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.config import JobSpec, pretrained_config
from workers.models import PretrainedLM, RingModel, Transformer
from workers.models.hf import ATTN_NAME, register_ring_attention


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to `meta`; buffers keep their real values."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:  # named as the method it replaces
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
    """The job's model with parameters on `meta`, without activation checkpointing (`parallelize` adds it)."""
    m = spec.model
    with parameters_on_meta():
        if m.kind == "hf":
            from transformers import AutoConfig, AutoModelForCausalLM

            register_ring_attention()
            config = AutoConfig.for_model(**pretrained_config(str(m.path), **m.overrides()))
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTN_NAME)
            return PretrainedLM(hf, source_dir=str(m.path))
        return Transformer(m)


def materialize(model: nn.Module, spec: JobSpec, device: torch.device) -> None:
    """Allocate this rank's shards on `device` and fill them (from the seed, or the pretrained files)."""
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
    if isinstance(model, Transformer):
        _init_native(model, spec.train.seed)
    elif isinstance(model, PretrainedLM):
        if spec.model.kind != "hf":
            raise TypeError(f"a pretrained model needs model.kind 'hf', not {spec.model.kind!r}")
        _load_pretrained_shards(model, str(spec.model.path))
    else:
        raise TypeError(f"cannot materialize a {type(model).__name__}")


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied LM head and input embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _keep_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full value `full` into `param` (a DTensor shard or a plain tensor)."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    _local(param).copy_(_local(full))


@torch.no_grad()
def _init_native(model: Transformer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        _keep_shard(p, model.init_value(name, p.shape, generator))


def _load_pretrained_shards(model: PretrainedLM, path: str) -> None:
    reader = HuggingFaceStorageReader(path)
    on_disk = set(reader.read_metadata().state_dict_metadata)
    state: dict[str, Any] = {}
    for key, value in get_model_state_dict(model).items():
        name = key.removeprefix("hf.")
        if name in on_disk:
            state[name] = value
        elif not _tied(model, name):
            raise ValueError(f"{path}: no weights for {name!r} in the safetensors files")
    dcp_load(state, storage_reader=reader)


def _tied(model: PretrainedLM, name: str) -> bool:
    """A tied LM head is the input embedding: checkpoints store it once."""
    return name == "lm_head.weight" and bool(getattr(model.hf.config, "tie_word_embeddings", False))
