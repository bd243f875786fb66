"""`fit`'s shape rules that the budget tests do not reach: every length the job trains on must divide
by the shape's sequence divisor (a curriculum's shorter contexts too), and a node holds whole tensor
groups only (a node of 3 devices runs one group of 2, not one and a half)."""

from __future__ import annotations

from service.launcher import ClusterInfo, NodeInfo
from service.planner import GIB, fit, memory_estimate
from workers.config import KNOB_CANDIDATES, JobSpec
from workers.parallel_dims import ParallelDims


def shaped_estimate(spec: JobSpec, ring: int, knobs: dict[str, object], acc: str) -> int:
    parallel = spec.parallel.model_copy(update={"ring_size": ring})
    train = spec.train.model_copy(update=knobs)
    return int(
        memory_estimate(spec.model_copy(update={"parallel": parallel, "train": train}), acc)[
            "total_bytes"
        ]
    )


def test_a_curriculum_length_rules_out_the_rings_it_does_not_divide() -> None:
    """65,536 tokens fit on a ring of 4 at this budget, ring 2 does not; a curriculum stage of 100
    tokens divides by 4 (ring 2, zigzag) but not by 8 (ring 4), so ring 4 is never a candidate."""
    base = {
        "name": "fit-curriculum",
        "train": {"steps": 10},
        "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
        "data": {"kind": "passkey", "seq_len": 65536},
        "parallel": {"ring_size": "auto"},
    }
    cluster = ClusterInfo(
        [NodeInfo(f"n{i}", "", True, 8, 8, 0, 0, memory_bytes=16 * GIB) for i in range(2)]
    )
    budget = int(0.76 * GIB)
    plain = JobSpec.model_validate(base)
    full = {"activation_checkpointing": "full", "tiled_mlp": "off", "offload_activations": False}
    full_tiled = {**full, "tiled_mlp": "auto"}  # the leanest knobs on a CPU
    assert (
        shaped_estimate(plain, 4, full, "cpu")
        <= budget
        < shaped_estimate(plain, 2, full_tiled, "cpu")
    )
    assert fit(plain, cluster, budget).ring_size == 4
    staged = JobSpec.model_validate(
        {**base, "data": {**base["data"], "curriculum": [{"steps": 2, "seq_len": 100}]}}
    )
    f = fit(staged, cluster, budget)
    # ring 4 is out; fit goes on to tensor parallelism, on a shape whose divisor divides 100
    assert f.fits and (f.ring_size, f.tensor_size) != (4, 1), f.message
    shapes = [(f.ring_size, f.ulysses_size, f.tensor_size)]
    shapes += [(r["ring_size"], r["ulysses_size"], r["tensor_size"]) for r in f.alternatives]
    for ring, ulysses, tensor in shapes:
        dims = ParallelDims(ring_size=ring, ulysses_size=ulysses, tensor_size=tensor)
        assert 100 % dims.seq_divisor("zigzag") == 0, (ring, ulysses, tensor, f.message)


def test_a_node_holds_whole_tensor_groups_only() -> None:
    """Six nodes of 3 GPUs hold 6 groups of tensor_size 2 (12 ranks, not 18): a ring of 8 (16 ranks)
    is beyond them even where it alone would fit the budget, so fit reports the shortfall."""
    spec = JobSpec.model_validate(
        {
            "name": "fit-tp",
            "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
            "data": {"kind": "passkey", "seq_len": 65536},
            "parallel": {"ring_size": "auto", "tensor_size": 2},
            "resources": {"accelerator": "gpu"},
        }
    )
    cluster = ClusterInfo(
        [NodeInfo(f"g{i}", "", True, 32, 32, 3, 3, gpu_memory_bytes=80 * GIB) for i in range(6)]
    )
    lean = KNOB_CANDIDATES[-1].fields()
    ring8, ring4 = (shaped_estimate(spec, r, lean, "gpu") for r in (8, 4))
    budget = (ring8 + ring4) // 2
    assert ring8 <= budget < ring4  # the bracket this test relies on
    f = fit(spec, cluster, budget)
    assert not f.fits and f.ring_size == 4 and f.tensor_size == 2, f.message
    assert "16 devices (ring_size 8" in f.message, f.message
