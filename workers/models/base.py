"""`RingModel`: the interface every model kind implements, so trainer, evals and export never ask
which kind they hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from workers.models.llama import SequenceParallel


class RingModel(nn.Module):
    """A model the ring trains: `forward(tokens [batch, seq_local], positions) -> fp32 logits`.

    A base class rather than a Protocol because callers also need it as an nn.Module (FSDP,
    optimizer, checkpoints). Subclasses also expose their decoder blocks as `layers` (an
    nn.ModuleList), which activation checkpointing and FSDP wrap one by one; it is not declared
    here because one kind holds it as an attribute and another computes it.
    """

    def set_sequence_parallel(self, sp: SequenceParallel | None) -> None:
        """Run attention on this ring from now on (None: plain local attention)."""
        raise NotImplementedError

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """The ring attention runs on (None: plain local attention)."""
        raise NotImplementedError

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head [vocab, hidden]: `forward` is `features` @ output_weight^T (chunked loss)."""
        raise NotImplementedError

    def sequence_ends(self) -> tuple[nn.Module, nn.Module]:
        """The modules where the residual stream begins and ends: the token embedding and the
        final norm (tensor parallelism splits the stream between them)."""
        raise NotImplementedError

    def features(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [batch, seq_local, hidden]."""
        raise NotImplementedError
