"""Dry-run planning of a job spec against a cluster snapshot: placement preview and memory estimate.

`preview` (where the ranks land: `plan`), `memory` (`memory_estimate`, parameter counts) and
`fitting` (`fit`: the smallest shape and cheapest knobs that fit a budget). Nothing is reserved.
"""

from service.planner.fitting import (
    GIB,
    MAX_ALTERNATIVES,
    Fit,
    device_memory,
    fit,
)
from service.planner.memory import (
    CPU_RUNTIME_BYTES,
    CPU_RUNTIME_TP_BYTES,
    LOSS_CHUNK_TOKENS,
    activation_terms,
    balanced_split,
    block_param_count,
    local_block_param_count,
    memory_estimate,
    param_count,
    pipeline_rank_bytes,
    resolve_pipeline_split,
)
from service.planner.preview import (
    Plan,
    RankSlot,
    node_resources,
    plan,
    preview_landing,
    suggest_split,
)

__all__ = [
    "CPU_RUNTIME_BYTES",
    "CPU_RUNTIME_TP_BYTES",
    "GIB",
    "LOSS_CHUNK_TOKENS",
    "MAX_ALTERNATIVES",
    "Fit",
    "Plan",
    "RankSlot",
    "activation_terms",
    "balanced_split",
    "block_param_count",
    "device_memory",
    "fit",
    "local_block_param_count",
    "memory_estimate",
    "node_resources",
    "param_count",
    "pipeline_rank_bytes",
    "plan",
    "preview_landing",
    "resolve_pipeline_split",
    "suggest_split",
]
