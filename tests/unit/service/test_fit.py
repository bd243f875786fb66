"""`service.planner.fit` and `parallel.ring_size: auto`: known answers on constructed clusters.

The model (d_model 256, 4 layers, 65,536 tokens) is small enough that the estimate's parts are
MiB-sized, so the budgets below sit between two shapes' estimates; each test asserts the bracket
it relies on before the answer, so a change in the estimate fails loudly here rather than silently
moving the answer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service import capacity
from service.launcher import ClusterInfo, NodeInfo
from service.planner import GIB, device_memory, fit, memory_estimate
from workers.config import KNOB_CANDIDATES, JobSpec, MemoryKnobs

FULL = {"activation_checkpointing": "full", "tiled_mlp": "off", "offload_activations": False}
FULL_TILED = {**FULL, "tiled_mlp": "auto"}


def make_spec(batch_size: int = 1, **parallel: object) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "fit",
            "train": {"batch_size": batch_size},
            "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
            "data": {"kind": "passkey", "seq_len": 65536},
            "parallel": {"ring_size": "auto", **parallel},
        }
    )


def cpu_cluster(nodes: int = 2, cpus: int = 8, memory_gib: float = 16) -> ClusterInfo:
    mem = memory_gib * GIB
    return ClusterInfo(
        [NodeInfo(f"n{i}", "", True, cpus, cpus, 0, 0, memory_bytes=mem) for i in range(nodes)]
    )


def gpu_cluster(gpu_memory_gib: float | None = 80) -> ClusterInfo:
    mem = (gpu_memory_gib or 0) * GIB
    return ClusterInfo(
        [NodeInfo(f"g{i}", "", True, 64, 64, 8, 8, gpu_memory_bytes=mem) for i in range(2)]
    )


def estimate(spec: JobSpec, ring: int, knobs: dict[str, object], acc: str = "cpu") -> int:
    parallel = spec.parallel.model_copy(update={"ring_size": ring})
    train = spec.train.model_copy(update=knobs)
    shaped = spec.model_copy(update={"parallel": parallel, "train": train})
    return int(memory_estimate(shaped, acc)["total_bytes"])


def test_smallest_ring_then_cheapest_knobs():
    spec, budget = make_spec(), int(0.76 * GIB)
    assert estimate(spec, 2, FULL_TILED) > budget  # ring 2 cannot fit with any knobs
    assert estimate(spec, 4, {**FULL, "activation_checkpointing": "none"}) > budget
    assert estimate(spec, 4, FULL) <= budget
    f = fit(spec, cpu_cluster(), budget)
    assert f.fits and (f.ring_size, f.ulysses_size) == (4, 1)
    assert f.knobs == MemoryKnobs(**FULL)  # full (0.79) before full+tiled (0.67), though both fit
    assert f.spec is not None and f.spec.parallel.ring_size == 4
    assert f.spec.train.activation_checkpointing == "full" and f.spec.train.tiled_mlp == "off"
    assert f.memory["total_bytes"] <= budget
    tried = [(a["ring_size"], a["knobs"]) for a in f.alternatives]
    assert (2, "full+tiled") in tried and tried[-1] == (4, "full")
    # at ring 4, every cheaper set was tried first, in cost order
    assert [k for r, k in tried if r == 4] == ["none", "selective", "tiled", "full"]
    assert 3 not in {r for r, _ in tried}  # 65,536 is not divisible by zigzag's 2 x 3


def test_knobs_are_ordered_by_measured_cost():
    names = [k.name for k in KNOB_CANDIDATES]
    assert names[:5] == ["none", "selective", "tiled", "full", "full+tiled"]
    assert all("offload" in n for n in names[5:])


def test_budget_from_the_bundles_share_of_node_memory():
    spec = make_spec()
    budget, _ = device_memory(spec, cpu_cluster(memory_gib=12))
    assert budget == 1.5 * GIB  # 12 GiB / 8 CPUs x 1 CPU per rank
    assert estimate(spec, 1, FULL) > budget >= estimate(spec, 1, FULL_TILED)
    f = fit(spec, cpu_cluster(memory_gib=12))
    assert f.fits and f.ring_size == 1 and f.knobs == MemoryKnobs(**FULL_TILED)
    assert f.memory_per_rank_bytes == 1.5 * GIB


def test_gpu_prefers_ulysses_inside_a_node():
    spec = make_spec()
    f = fit(spec, gpu_cluster(), int(0.3 * GIB))
    assert f.fits and f.accelerator == "gpu"
    assert f.ulysses_size > 1 and f.ring_size * f.ulysses_size <= 16
    # the sequence group is the smallest that fits, and within it Ulysses is as large as allowed
    group = f.ring_size * f.ulysses_size
    assert f.ulysses_size == max(u for u in (1, 2, 4, 8) if group % u == 0)
    smaller = [a for a in f.alternatives if a["ring_size"] * a["ulysses_size"] < group]
    assert smaller and not any(a["fits"] for a in smaller)


def test_gpu_memory_unknown_needs_a_budget():
    with pytest.raises(ValueError, match="does not report its GPUs"):
        fit(make_spec(), gpu_cluster(gpu_memory_gib=None))
    assert fit(make_spec(), gpu_cluster(gpu_memory_gib=None), 4 * GIB).fits


def test_offload_only_on_cuda():
    f = fit(make_spec(), cpu_cluster(nodes=1, cpus=4), int(0.2 * GIB))
    assert not f.fits and all("offload" not in a["knobs"] for a in f.alternatives)


def test_data_parallel_kept_and_world_within_the_cluster():
    spec = make_spec(batch_size=2, data_parallel=2)
    f = fit(spec, cpu_cluster(nodes=1, cpus=8), int(0.76 * GIB))
    assert f.fits and f.spec is not None
    assert f.spec.parallel.data_parallel == 2 and f.spec.world_size <= 8
    assert f.ring_size == 4


def test_nothing_fits_says_by_how_much_and_what_would():
    spec, budget = make_spec(), int(0.45 * GIB)
    f = fit(spec, cpu_cluster(nodes=1, cpus=4), budget)
    best = estimate(spec, 4, FULL_TILED)
    assert not f.fits and f.ring_size == 4 and f.knobs == MemoryKnobs(**FULL_TILED)
    assert f.shortfall_bytes == best - budget > 0
    assert f"{f.shortfall_bytes} bytes" in f.message
    assert f"({f.shortfall_bytes / GIB:.2f} GiB) over" in f.message
    assert "16 devices" in f.message and "the cluster has 4" in f.message
    never = fit(spec, cpu_cluster(nodes=1, cpus=4), int(0.2 * GIB))  # below the CPU runtime
    assert not never.fits and "devices (" not in never.message


def test_ring_auto_validation():
    spec = make_spec()
    assert spec.parallel.ring_auto
    assert spec.model_dump(mode="json")["parallel"]["ring_size"] == "auto"
    # what every ring needs is still checked: zigzag needs an even length
    with pytest.raises(ValidationError, match="divisible by 2"):
        JobSpec.model_validate(
            {
                "name": "x",
                "data": {"kind": "passkey", "seq_len": 1001},
                "parallel": {"ring_size": "auto"},
            }
        )
    for bad in (0, "4", "AUTO"):
        with pytest.raises(ValidationError):
            JobSpec.model_validate({"name": "x", "parallel": {"ring_size": bad}})


def test_ring_auto_resolves_to_a_stored_spec():
    chosen, result = capacity.fit_spec(make_spec(), cpu_cluster(), int(0.76 * GIB))
    again = JobSpec.model_validate(chosen.model_dump(mode="json"))
    assert again.parallel.ring_size == 4 and not again.parallel.ring_auto
    assert again.train.activation_checkpointing == "full" and result.fits
    with pytest.raises(capacity.FitError) as e:
        capacity.fit_spec(make_spec(), cpu_cluster(nodes=1, cpus=4), int(0.45 * GIB))
    assert e.value.result is not None and e.value.result.shortfall_bytes > 0


def test_fit_turns_to_tensor_parallelism_when_a_block_does_not_fit():
    """A wide model (d_model 4096, MLP 16384): FSDP gathers two whole blocks on every rank
    whatever the ring, so no ring fits a budget below that; tensor_size 2 halves the blocks."""
    spec = JobSpec.model_validate(
        {
            "name": "wide",
            "model": {"d_model": 4096, "n_layers": 2, "n_heads": 32, "n_kv_heads": 8},
            "data": {"kind": "passkey", "seq_len": 4096},
            "parallel": {"ring_size": "auto"},
            "resources": {"accelerator": "gpu"},
        }
    )
    cluster = gpu_cluster()
    lean = {**FULL_TILED, "offload_activations": True}

    def shaped(ring: int, tensor: int) -> int:
        parallel = spec.parallel.model_copy(update={"ring_size": ring, "tensor_size": tensor})
        train = spec.train.model_copy(update=lean)
        candidate = spec.model_copy(update={"parallel": parallel, "train": train})
        return int(memory_estimate(candidate, "gpu")["total_bytes"])

    best_without = min(shaped(ring, 1) for ring in (1, 2, 4, 8, 16))
    budget = (best_without + shaped(8, 2)) // 2
    assert shaped(8, 2) < budget < best_without  # the bracket this test relies on
    f = fit(spec, cluster, budget)
    assert f.fits and f.tensor_size == 2 and f.spec is not None
    assert f.spec.parallel.tensor_size == 2 and "tensor_size 2" in f.message
    assert all(row["tensor_size"] in (1, 2) for row in f.alternatives)


def test_fit_counts_the_pipeline_in_the_world():
    """pipeline_size 2: every pipeline rank holds a sequence group of its own, so on 8 devices
    the group is at most 4 (world = P x group); ring 8, which alone fits 0.5 GiB, needs 16."""
    spec = JobSpec.model_validate(
        {
            "name": "fit-pp",
            "train": {"batch_size": 2, "microbatches": 2},
            "model": {"d_model": 256, "n_layers": 4, "n_heads": 8, "tie_embeddings": False},
            "data": {"kind": "passkey", "seq_len": 65536},
            "parallel": {"ring_size": "auto", "pipeline_size": 2},
            "verify": {"enabled": False},
            "eval": {"enabled": False},
        }
    )
    cluster = cpu_cluster(nodes=1, cpus=8)
    assert estimate(spec, 8, FULL_TILED) <= int(0.5 * GIB) < estimate(spec, 4, FULL_TILED)
    short = fit(spec, cluster, int(0.5 * GIB))
    assert not short.fits and short.ring_size == 4, short.message
    assert "or 16 devices (ring_size 8" in short.message and "the cluster has 8" in short.message
    ok = fit(spec, cluster, int(0.6 * GIB))
    assert ok.fits and ok.spec is not None and ok.ring_size == 4
    assert ok.spec.parallel.pipeline_size == 2 and ok.spec.world_size == 8
