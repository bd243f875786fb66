"""`RingModel`: the interface every model kind implements, so trainer, evals and export never ask
which kind they hold; `SequenceParallel`: where any kind's attention runs (its ring and Ulysses
groups), set on a model from outside."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from workers import attention


@dataclass(frozen=True)
class SequenceParallel:
    """Where a model's attention runs: the ring (`group`; None with torch.distributed off is a ring
    of one) and, for Ulysses × ring, the Ulysses group whose all-to-all trades sequence for heads
    around it."""

    group: dist.ProcessGroup | None
    layout: str = "zigzag"
    ulysses_group: dist.ProcessGroup | None = None

    @property
    def world(self) -> int:
        """Ranks one sequence is spread over (ring × Ulysses). A ring `group` of None is the default
        group, as in `ring_attention`."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        ring = dist.get_world_size(self.group)
        return ring * (
            dist.get_world_size(self.ulysses_group) if self.ulysses_group is not None else 1
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of this rank's shard, [batch, seq_local, heads, head_dim] in and out."""
        if self.ulysses_group is not None and dist.get_world_size(self.ulysses_group) > 1:
            if (
                self.group is None
            ):  # ring_attention would take None for the whole world, not a ring of one
                raise ValueError(
                    "SequenceParallel with a Ulysses group needs its ring group "
                    "(one rank for no ring)"
                )
            return attention.usp_attention(
                q,
                k,
                v,
                causal=True,
                layout=self.layout,
                ulysses_group=self.ulysses_group,
                ring_group=self.group,
                softmax_scale=softmax_scale,
                cu_seqlens=cu_seqlens,
            )
        return attention.ring_attention(
            q,
            k,
            v,
            causal=True,
            layout=self.layout,
            group=self.group,
            softmax_scale=softmax_scale,
            cu_seqlens=cu_seqlens,
        )


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
