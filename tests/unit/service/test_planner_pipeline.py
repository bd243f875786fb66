"""The planner's memory estimate under pipeline parallel: a pipeline rank holds its layers' state
and the activations of the microbatches its schedule keeps in flight."""

from __future__ import annotations

from typing import Any

import pytest

from service.planner.memory import (
    balanced_split,
    memory_estimate,
    microbatches_in_flight,
    pipeline_rank_bytes,
    resolve_pipeline_split,
    schedule_ops,
)
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
    # 4 of 8 blocks' state and its stage's part of the root (the embedding; the last stage has
    # the norm and the head): half the whole model's, less half the final norm
    assert pb["params"] == 4 * (memory_estimate(_spec())["param_count"] - 256) // 2 // 2
    assert pb["pipeline_buffers"] > 0 and "pipeline_buffers" not in fb
    inter = memory_estimate(
        _spec(pipeline_size=2, microbatches=8, pipeline_schedule="interleaved_1f1b")
    )
    assert inter["bytes"]["activations"] > pb["activations"]  # more microbatches in flight
    zb = memory_estimate(_spec(pipeline_size=2, microbatches=8, pipeline_schedule="zero_bubble"))
    same_rank = pipeline_rank_bytes(_spec(pipeline_size=2, microbatches=8))
    busiest = zb["pipeline"]["busiest_rank"]
    # no FSDP under zero_bubble: S = 1, not 2
    assert zb["bytes"]["params"] == 2 * same_rank[busiest]["params"]
    assert zb["bytes"]["gathered"] == 0 < pb["gathered"]


def test_in_flight_per_rank_follows_each_schedule() -> None:
    """torch.distributed.pipelining's warmups, rank by rank: 1F1B's stage r runs P - r forwards
    before its first backward; interleaved 1F1B (V - 1) m_r + 2 (P - 1 - r), then one more
    forward before the first backward; zero bubble (V - 1) m_r + (P - 1 - r) and keeps a
    microbatch until its deferred weight gradient."""
    assert [microbatches_in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("interleaved_1f1b", 2, 4, r) for r in range(2)] == [5, 3]
    assert [microbatches_in_flight("zero_bubble", 4, 8, r) for r in range(4)] == [8] * 4
    ops = schedule_ops("interleaved_1f1b", 2, 4, 1)
    # rank 1 (stages 1 and 3): a round of 2 forwards of stage 1, then forward-backward pairs,
    # the first of them on the last stage (3)
    assert ops[:4] == [("F", 0), ("F", 0), ("F", 1), ("B", 1)]
    assert sorted(ops) == sorted([("F", 0), ("F", 1), ("B", 0), ("B", 1)] * 4)


def _split_spec(split: Any, layers: int = 25, seq: int = 16384, **parallel: Any) -> JobSpec:
    """Long microbatches (activations dominate the state) of a byte-vocabulary model."""
    return JobSpec.model_validate(
        {
            "name": "pp-split",
            "model": {"d_model": 64, "n_layers": layers, "n_heads": 4, "tie_embeddings": False},
            "data": {"kind": "passkey", "seq_len": seq},
            "parallel": {"pipeline_size": 4, "pipeline_split": split, **parallel},
            "train": {"batch_size": 4, "microbatches": 4},
            "verify": {"enabled": False},
            "eval": {"enabled": False},
            "resources": {"accelerator": "cpu"},
        }
    )


def test_ranks_hold_their_own_root_loss_and_microbatches() -> None:
    ranks = pipeline_rank_bytes(_split_spec([6, 6, 6, 7]))
    # the embedding on the first stage, the head and the loss on the last, nothing at the middle
    assert ranks[0]["loss"] == ranks[1]["loss"] == ranks[2]["loss"] == 0 < ranks[3]["loss"]
    assert ranks[0]["params"] > ranks[1]["params"] == ranks[2]["params"] < ranks[3]["params"]
    # 6 layers x 4, 3, 2 microbatches in flight (1F1B's warmup): activations in that ratio
    per = [ranks[r]["activations"] / 6 for r in range(3)]
    assert per[0] / 4 == pytest.approx(per[1] / 3, rel=1e-6) == pytest.approx(per[2] / 2, rel=1e-6)
    est = memory_estimate(_split_spec([6, 6, 6, 7]))
    assert est["pipeline"]["busiest_rank"] == 0 and est["total_bytes"] == sum(ranks[0].values())


def test_auto_split_balances_the_microbatches_in_flight() -> None:
    """Hand-computed: 1F1B over 4 ranks keeps 4, 3, 2, 1 microbatches in flight, so with the
    activations dominating, rank r's bytes grow as (4 - r) x its layers; 25 layers balance as
    3, 4, 6, 12 (12 microbatch-layers each). Any other split puts more on some rank."""
    spec = _split_spec("auto")
    assert balanced_split(spec) == [3, 4, 6, 12]
    est = memory_estimate(spec)
    assert est["pipeline"]["split"] == [3, 4, 6, 12]
    even = memory_estimate(_split_spec([6, 6, 6, 7]))
    assert est["total_bytes"] < 0.6 * even["total_bytes"]
    for other in ([4, 4, 6, 11], [3, 4, 7, 11], [3, 5, 6, 11], [2, 4, 6, 13]):
        assert memory_estimate(_split_spec(other))["total_bytes"] > est["total_bytes"]


def test_auto_split_of_two_stages_per_rank_and_its_resolution() -> None:
    spec = _split_spec("auto", layers=16, pipeline_schedule="interleaved_1f1b")
    split = balanced_split(spec)
    assert len(split) == 8 and sum(split) == 16 and min(split) >= 1
    even = memory_estimate(_split_spec([2] * 8, layers=16, pipeline_schedule="interleaved_1f1b"))
    assert memory_estimate(spec)["total_bytes"] <= even["total_bytes"]
    # submission stores the chosen split: a plain list the trainer runs, valid on its own
    stored = resolve_pipeline_split(spec)
    assert stored.parallel.pipeline_split == split
    assert JobSpec.model_validate(stored.model_dump(mode="json")) == stored
    assert resolve_pipeline_split(stored) is stored  # nothing left to resolve


def test_auto_split_is_resolved_per_stage() -> None:
    """A job with stages: each stage's own shape gets its own split (here a stage with 4 pipeline
    ranks), written into the stage as submission stores what it resolved."""
    data = _split_spec("auto", layers=8, seq=4096, pipeline_size=2).model_dump(mode="json")
    data["stages"] = [{"steps": 5}, {"steps": 5, "parallel": {"pipeline_size": 4}}]
    data["train"].pop("steps")
    stored = resolve_pipeline_split(JobSpec.model_validate(data))
    splits = [st.spec.parallel.pipeline_split for st in stored.stage_plan()]
    assert splits == [balanced_split(st.spec) for st in stored.stage_plan()]
    assert [len(s) for s in splits] == [2, 4] and all(sum(s) == 8 for s in splits)
    assert isinstance(stored.parallel.pipeline_split, list)


def test_offloaded_bytes_count_each_microbatch_stage_with_its_own_layers() -> None:
    """Host bytes under offload: the microbatch-stages in flight, each of one stage's layers.
    8 layers, 4 microbatches, P 2: against the whole model's offloaded bytes (all 8 layers of the
    whole batch), rank 1 holds 1 (1f1b, 4 layers), 3 (interleaved) or 4 (zero bubble) microbatch-
    stages of 2 layers, i.e. 4, 6 or 8 of the 32 microbatch-layers."""

    def spec(pp: int, schedule: str, m: int) -> JobSpec:
        return JobSpec.model_validate(
            {
                "name": "pp-offload",
                "model": {"d_model": 64, "n_layers": 8, "n_heads": 4, "tie_embeddings": False},
                "data": {"kind": "passkey", "seq_len": 4096},
                "parallel": {"pipeline_size": pp, "pipeline_schedule": schedule},
                "train": {
                    "batch_size": 4,
                    "microbatches": m,
                    "activation_checkpointing": "full",
                    "offload_activations": True,
                },
                "verify": {"enabled": False},
                "eval": {"enabled": False},
                "resources": {"accelerator": "gpu"},
            }
        )

    whole = memory_estimate(spec(1, "1f1b", 1))["offloaded_bytes"]
    for schedule, layers in (("1f1b", 4), ("interleaved_1f1b", 6), ("zero_bubble", 8)):
        est = memory_estimate(spec(2, schedule, 4))
        assert est["pipeline"]["busiest_rank"] == 1
        assert est["offloaded_bytes"] * 32 == whole * layers, schedule
