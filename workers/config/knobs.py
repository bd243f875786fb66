"""The memory knobs as one value: what a rank does to trade compute for memory per token.

The spec keeps them as three `train` fields (`activation_checkpointing`, `tiled_mlp`,
`offload_activations`); `TrainConfig.knobs` reads them as a `MemoryKnobs`. Everything else takes
that value: the spec's rules and the rank's `parallelize` ask `problem()` (one rule, checked at
submission and again on the rank that would run it), the planner tries `CANDIDATES` cheapest
first, and people read `name` / `describe()`. A new knob is a field here, a field of
`TrainConfig`, the code that applies it (`workers.training.parallelize`) and its term in the
estimate (`service.planner.memory`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

Checkpointing = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class MemoryKnobs:
    activation_checkpointing: Checkpointing = "none"  # recompute each MLP / each block in backward
    tiled_mlp: Literal["off", "auto"] | int = "off"  # each MLP over N sequence tiles
    offload_activations: bool = False  # CUDA: checkpointed block inputs in pinned host memory

    @classmethod
    def read(cls, train: Mapping[str, Any]) -> MemoryKnobs:
        """The knobs of a `train` section as JSON (a stored spec); missing fields: defaults."""
        return cls(**{k: train[k] for k in cls.__dataclass_fields__ if k in train})

    @property
    def tiled(self) -> bool:
        return self.tiled_mlp != "off"

    @property
    def name(self) -> str:
        """Short words: 'none', 'selective', 'full+tiled+offload', ..."""
        parts: list[str] = []
        parts += [] if self.activation_checkpointing == "none" else [self.activation_checkpointing]
        parts += ["tiled"] if self.tiled else []
        parts += ["offload"] if self.offload_activations else []
        return "+".join(parts) or "none"

    def describe(self) -> str:
        """Every field with its spec name, for messages and the CLI."""
        offload = str(self.offload_activations).lower()
        return (
            f"activation_checkpointing {self.activation_checkpointing}, "
            f"tiled_mlp {self.tiled_mlp}, offload_activations {offload}"
        )

    def fields(self) -> dict[str, Any]:
        """The `train` fields these knobs are (for `TrainConfig.model_copy(update=...)` and
        JSON)."""
        return asdict(self)

    def problem(self, *, cuda: bool) -> tuple[str, str] | None:
        """Why this set cannot run on ranks with (`cuda`) or without GPUs: (field, message)."""
        if self.offload_activations and not cuda:
            return (
                "train.offload_activations",
                "train.offload_activations moves activations from GPU to host memory: it needs "
                "GPUs (resources.accelerator gpu or auto, not cpu)",
            )
        if self.offload_activations and self.activation_checkpointing != "full":
            return (
                "train.offload_activations",
                "train.offload_activations offloads the inputs that full checkpointing keeps: it "
                "needs train.activation_checkpointing: full",
            )
        return None


def mlp_tiles(tiled_mlp: str | int, local_tokens: int, d_model: int) -> int:
    """Sequence tiles per MLP call for `train.tiled_mlp` (1: untiled). `auto` keeps each tile at
    about d_model tokens, so a tile's intermediates (~4·ffn_hidden per token) stay near one
    layer's d_model² weights (ALST's rule); never more tiles than tokens."""
    if tiled_mlp == "off":
        return 1
    n = math.ceil(local_tokens / max(d_model, 1)) if tiled_mlp == "auto" else int(tiled_mlp)
    return max(1, min(n, local_tokens))


# Cheapest first in throughput (BENCHMARKS.md "Cost of each knob": none 1.00, selective 0.94,
# tiled 0.81, full 0.79, full + tiled 0.67); offload (CUDA only, unmeasured) after them.
CANDIDATES: tuple[MemoryKnobs, ...] = (
    MemoryKnobs("none"),
    MemoryKnobs("selective"),
    MemoryKnobs("none", "auto"),
    MemoryKnobs("full"),
    MemoryKnobs("full", "auto"),
    MemoryKnobs("full", "off", True),
    MemoryKnobs("full", "auto", True),
)
