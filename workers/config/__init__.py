"""The job spec: one pydantic model, used by the trainer, the driver, the service and the API.

Kept free of torch/ray imports so the control plane can validate specs without loading them.
Cross-field rules raise errors located at the offending field (e.g. ``data.seq_len``) so that
the API can answer 422 naming it. `workers.config` is the public import path; the modules:
`base` (strict fields, errors at a path), `sections` (data, parallel, train, ...), `models` (the
native config and the kind table), `pretrained` (`model.kind: hf`), `knobs` (the memory knobs as one
value), `rules` (cross-section rules the planner also asks), `stages` (a job's stages and each one's
effective spec), `elastic` (the shapes an elastic job may run on), `spec` (`JobSpec`, `load_spec`).
"""

from workers.config.base import MAX_MLP_TILES, MAX_SEQ_LEN, MAX_WORLD, Layout, StrictModel
from workers.config.elastic import ElasticConfig, never_shrinks, resized, shapes
from workers.config.init_from import InitFrom, architecture_problem
from workers.config.knobs import CANDIDATES as KNOB_CANDIDATES
from workers.config.knobs import MemoryKnobs, mlp_tiles
from workers.config.models import MODEL_CONFIGS, ModelConfig, ModelSection
from workers.config.pretrained import (
    PRETRAINED_FAMILIES,
    ROPE_TYPES,
    SKIP_FILE_CHECKS,
    HFModelConfig,
    RopeScaling,
    check_pretrained_dir,
    pretrained_config,
    read_config_json,
)
from workers.config.rules import (
    rope_coverage_warning,
    tensor_heads_problem,
    ulysses_heads_problem,
)
from workers.config.sections import (
    AUTO_RING,
    CheckpointConfig,
    CurriculumStage,
    DataConfig,
    EvalConfig,
    ParallelConfig,
    PasskeyData,
    ResourcesConfig,
    TextData,
    TokensData,
    TrainConfig,
    VerifyConfig,
)
from workers.config.spec import JobSpec, load_spec
from workers.config.stages import Stage, StageConfig, with_overrides

__all__ = [
    "AUTO_RING",
    "KNOB_CANDIDATES",
    "MAX_MLP_TILES",
    "MAX_SEQ_LEN",
    "MAX_WORLD",
    "MODEL_CONFIGS",
    "PRETRAINED_FAMILIES",
    "ROPE_TYPES",
    "SKIP_FILE_CHECKS",
    "CheckpointConfig",
    "CurriculumStage",
    "DataConfig",
    "ElasticConfig",
    "EvalConfig",
    "HFModelConfig",
    "InitFrom",
    "JobSpec",
    "Layout",
    "MemoryKnobs",
    "ModelConfig",
    "ModelSection",
    "ParallelConfig",
    "PasskeyData",
    "ResourcesConfig",
    "RopeScaling",
    "Stage",
    "StageConfig",
    "StrictModel",
    "TextData",
    "TokensData",
    "TrainConfig",
    "VerifyConfig",
    "architecture_problem",
    "check_pretrained_dir",
    "load_spec",
    "mlp_tiles",
    "never_shrinks",
    "pretrained_config",
    "read_config_json",
    "resized",
    "rope_coverage_warning",
    "shapes",
    "tensor_heads_problem",
    "ulysses_heads_problem",
    "with_overrides",
]
