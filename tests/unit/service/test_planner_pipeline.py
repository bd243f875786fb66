"""The planner's memory estimate under pipeline parallel: a pipeline rank holds its layers' state
and the activations of the microbatches its schedule keeps in flight."""

from __future__ import annotations

from typing import Any

from service.planner.memory import memory_estimate, microbatches_in_flight
from workers.config import JobSpec


def _spec(**parallel: Any) -> JobSpec:
    m = parallel.pop("microbatches", 1)
    return JobSpec.model_validate(
        {
            "name": "pp-plan",
            "model": {"d_model": 256, "n_layers": 8, "n_heads": 8, "tie_embeddings": False},
            "data": {"kind": "passkey", "seq_len": 4096},
            "parallel": {"ring_size": 2, **parallel},
            "train": {"batch_size": 8, "microbatches": m},
            "verify": {"enabled": False},
            "eval": {"enabled": False},
            "resources": {"accelerator": "cpu"},
        }
    )


def test_in_flight_per_schedule() -> None:
    assert microbatches_in_flight("1f1b", 4, 8) == 4
    assert microbatches_in_flight("1f1b", 4, 2) == 2
    # interleaved, rank 0: (V - 1) x a round of P, then 2 (P - 1) more, then the first 1F1B pair
    assert microbatches_in_flight("interleaved_1f1b", 4, 8) == 4 + 6 + 1
    assert microbatches_in_flight("zero_bubble", 2, 2) == 4


def test_pipeline_rank_holds_its_layers_and_microbatches_in_flight() -> None:
    flat = memory_estimate(_spec())
    pp = memory_estimate(_spec(pipeline_size=2, microbatches=8))
    fb, pb = flat["bytes"], pp["bytes"]
    assert pp["world_size"] == 4 and pp["pipeline"]["layers_on_rank"] == 4
    # 1F1B keeps 2 microbatches (1 row each) of 4 layers in flight: 2/8 x 4/8 of the layers'
    # activations, plus the embedding-side terms per microbatch
    assert pp["pipeline"]["microbatches_in_flight"] == 2
    assert pb["activations"] < fb["activations"] * 0.2
    # 4 of 8 blocks' state, the root whole: between half and all of it
    assert fb["params"] / 2 < pb["params"] < fb["params"]
    assert pb["pipeline_buffers"] > 0 and "pipeline_buffers" not in fb
    inter = memory_estimate(
        _spec(pipeline_size=2, microbatches=8, pipeline_schedule="interleaved_1f1b")
    )
    assert inter["bytes"]["activations"] > pb["activations"]  # more microbatches in flight
    zb = memory_estimate(_spec(pipeline_size=2, microbatches=8, pipeline_schedule="zero_bubble"))
    assert zb["bytes"]["params"] == 2 * pb["params"]  # no FSDP under zero_bubble: S = 1, not 2
