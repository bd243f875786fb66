"""Activation offload: the inputs that full checkpointing keeps per block live in host memory until
backward.

With full activation checkpointing a rank keeps one tensor per block from forward to backward, the
block's input ([batch, local tokens, d_model]); everything else is recomputed.
`offload_block_inputs` patches each checkpointed block's `forward` from outside: after the block has
run, its input is copied to (pinned) host memory on a side stream and its device storage is released
once the copy is done (one block later, so the copy overlaps the next block's compute). In backward,
a hook on the block's output (it fires when the gradient reaches the block, before the checkpoint
recomputes it) restores the input and starts copying the previous block's input back, so that copy
overlaps this block's recompute and backward.

The device tensor object stays the same (only its storage is released and re-allocated), so the
checkpoint's recompute reads it unchanged: the math is the same as without offload. Inputs that are
views into a larger storage are left on the device (releasing them would free someone else's data).

CUDA only in jobs (validation refuses it for CPU jobs); the same mechanism runs on CPU with plain
copies, which is how the tests check it is exact."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class _Stashed:
    tensor: weakref.ref[torch.Tensor]
    host: torch.Tensor
    nbytes: int
    copied: Any = None  # CUDA event: the device-to-host copy is done
    restored: Any = None  # CUDA event: the host-to-device copy is done
    released: bool = False
    back: bool = False


@dataclass
class BlockInputOffload:
    """Offload state shared by the blocks of one model: the stashed inputs of the current step, in
    order."""

    device: torch.device
    stash: list[_Stashed] = field(default_factory=list)
    offloaded_bytes: int = (
        0  # largest total held on the host in one step (for the memory breakdown)
    )

    def __post_init__(self) -> None:
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None

    # -- forward -----------------------------------------------------------------------------------
    def after_block(self, index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if index == 0:
            self.stash = []
        if not (torch.is_grad_enabled() and y.requires_grad) or not _owns_storage(x):
            return
        entry = self._to_host(x)
        self.stash.append(entry)
        position = len(self.stash) - 1
        y.register_hook(self._restore_hook(position))
        if position > 0:
            self._release(self.stash[position - 1])  # its copy had a whole block to finish
        self.offloaded_bytes = max(self.offloaded_bytes, sum(e.nbytes for e in self.stash))

    def _to_host(self, x: torch.Tensor) -> _Stashed:
        nbytes = x.untyped_storage().nbytes()
        if not self.cuda:
            return _Stashed(weakref.ref(x), x.detach().to("cpu", copy=True), nbytes)
        assert self.side is not None
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            host.copy_(x.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        return _Stashed(weakref.ref(x), host, nbytes, copied=done)

    def _release(self, entry: _Stashed) -> None:
        x = entry.tensor()
        if x is None or entry.released:
            return
        if entry.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.copied)
        x.untyped_storage().resize_(0)
        entry.released = True

    # -- backward ----------------------------------------------------------------------------------
    def _restore_hook(self, position: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._bring_back(position)
            if self.stash[position].restored is not None:
                torch.cuda.current_stream(self.device).wait_event(self.stash[position].restored)
            if position > 0:
                self._bring_back(
                    position - 1
                )  # prefetch: overlaps this block's recompute and backward

        return hook

    def _bring_back(self, position: int) -> None:
        entry = self.stash[position]
        x = entry.tensor()
        if entry.back or x is None:
            return
        entry.back = True
        if not entry.released:
            return
        x.untyped_storage().resize_(
            entry.nbytes
        )  # allocated on the compute stream, where it is used
        if not self.cuda:
            x.data.copy_(
                entry.host
            )  # `.data`: the same bytes back, without bumping autograd's version
            return
        assert self.side is not None
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            x.data.copy_(entry.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        entry.restored = done


def _owns_storage(x: torch.Tensor) -> bool:
    """True when `x` is the whole of its storage: releasing the storage then frees nothing else."""
    return (
        x.is_contiguous()
        and x.storage_offset() == 0
        and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    )


def offload_block_inputs(layers: nn.ModuleList, device: torch.device) -> BlockInputOffload:
    """Patch every block of `layers` (already checkpointed) to keep its input on the host until
    backward."""
    state = BlockInputOffload(device)
    for index, block in enumerate(layers):
        inner = block.forward

        def forward(
            x: torch.Tensor, *args: Any, _inner: Any = inner, _index: int = index, **kwargs: Any
        ) -> Any:
            y = _inner(x, *args, **kwargs)
            out = y[0] if isinstance(y, tuple) else y
            if isinstance(out, torch.Tensor):
                state.after_block(_index, x, out)
            return y

        block.forward = forward
    return state
