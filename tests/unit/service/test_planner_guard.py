"""`service.planner`'s memory estimate term by term, and `fit`'s boundaries, against numbers worked out
by hand from the formulas in the planner's module docstring (not read back from the code).

The model: native, d_model 64, 4 layers, 8 heads, 2 K/V heads, vocabulary 256, tied embeddings, so
head_dim e = 8, d_q = 64, d_kv = 16, SwiGLU f = 176 (2/3 * 4 * 64 = 170, rounded up to a multiple of 8),
a block 2*64*64 + 2*64*16 + 3*64*176 + 2*64 = 44,160 parameters, the root 256*64 + 64 = 16,448 and the
whole model P = 4*44,160 + 16,448 = 193,088. Per token, with T = tensor_size:
rest = 2d + 2d/T + 2d_q/T + 2d_kv/T + h/T (the native norm keeps 2 pieces), mlp = 4f/T."""

from __future__ import annotations

from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from service.planner import GIB, device_memory, fit, memory_estimate, plan
from workers.config import JobSpec, MemoryKnobs

MODEL = {"d_model": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2}


def small(train: dict[str, Any], accelerator: str = "cpu", **parallel: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "guard",
            "model": MODEL,
            "data": {"kind": "passkey", "seq_len": 1024},
            "parallel": {"ring_size": 2, **parallel},
            "train": train,
            "resources": {"accelerator": accelerator},
        }
    )


def test_every_term_of_a_gpu_rank_with_full_checkpointing_tiles_and_offload() -> None:
    """GPU (2-byte activations and gathered parameters), ring 2, batch 2: b*t = 2*512 = 1024 tokens.
    full: kept = L*d + d + e = 256 + 72 = 328, of which (L - 2)*d = 128 offloaded; working =
    rest/2 = 424 // 2 = 212 per token plus mlp = 704 per tile token; 3 tiles of ceil(1024/3) = 342."""
    spec = small(
        {
            "batch_size": 2,
            "activation_checkpointing": "full",
            "tiled_mlp": 3,
            "offload_activations": True,
        },
        accelerator="gpu",
    )
    est = memory_estimate(spec, "gpu")
    assert (est["param_count"], est["local_tokens"], est["mlp_tile_tokens"]) == (193088, 512, 342)
    assert est["bytes"] == {
        "runtime": 0,
        "params": 4 * 193088 // 2,  # sharded over the 2 ranks
        "grads": 4 * 193088 // 2,
        "adamw": 8 * 193088 // 2,
        # two blocks and the root in bf16, and their fp32 gradients (one block's)
        "gathered": 2 * (16448 + 2 * 44160) + 4 * (16448 + 44160),
        "activations": 2 * 1024 * (328 - 128),
        "backward_working_set": 2 * (1024 * 212 + 342 * 704),
        # one chunk's logits and softmax (2 x 1024 x 256), the head's gradient, hidden states and grad
        "loss": 4 * (2 * 1024 * 256 + 256 * 64 + 2 * 1024 * 64),
        # 2 K/V heads in 2 chunks: K and V of one head (2 x 8 floats), held and in flight, bf16 + fp32
        "ring_buffers": 1024 * 16 * 2 * (2 + 4),
    }
    assert est["offloaded_bytes"] == 2 * 1024 * 128


def test_selective_checkpointing_keeps_attention_and_recomputes_the_mlp() -> None:
    """CPU (4 bytes), ring 2, batch 1: 512 tokens. selective: kept = L*rest + d + e = 1696 + 72, and one
    MLP (704 floats per token) recomputed in the backward."""
    spec = small({"activation_checkpointing": "selective", "tiled_mlp": "off"})
    parts = memory_estimate(spec, "cpu")["bytes"]
    assert parts["activations"] == 4 * 512 * (4 * 424 + 72)
    assert parts["backward_working_set"] == 4 * 512 * 704


def test_full_checkpointing_under_tensor_parallelism_keeps_a_piece_of_each_block_input() -> None:
    """tensor_size 2 (GPU): each block keeps its input's 1/T piece, L*d/T = 128, + d + e = 200 per token;
    rest = 128 + 64 + 64 + 16 + 4 = 276 (halved: 138) and mlp = 4 * 88 = 352 in the backward."""
    spec = small(
        {"activation_checkpointing": "full", "tiled_mlp": "off"}, accelerator="gpu", tensor_size=2
    )
    parts = memory_estimate(spec, "gpu")["bytes"]
    assert parts["activations"] == 2 * 512 * 200
    assert parts["backward_working_set"] == 2 * 512 * (138 + 352)


def _cpu_cluster(nodes: int, cpus: int, memory_gib: float) -> ClusterInfo:
    mem = memory_gib * GIB
    return ClusterInfo(
        [NodeInfo(f"n{i}", "", True, cpus, cpus, 0, 0, memory_bytes=mem) for i in range(nodes)]
    )


def test_device_memory_is_the_smallest_gpu_or_a_bundles_share_of_the_smallest_node() -> None:
    """GPUs of 40 and 80 GiB: 40. CPU nodes of 16 GiB / 8 CPUs and 48 GiB / 8 CPUs at 2 CPUs per rank:
    min(4, 12) = 4 GiB."""
    gpus = ClusterInfo(
        [
            NodeInfo("g0", "", True, 8, 8, 1, 1, gpu_memory_bytes=80 * GIB),
            NodeInfo("g1", "", True, 8, 8, 1, 1, gpu_memory_bytes=40 * GIB),
        ]
    )
    assert device_memory(small({}, accelerator="gpu"), gpus)[0] == 40 * GIB
    cpus = ClusterInfo(
        [
            NodeInfo("c0", "", True, 8, 8, 0, 0, memory_bytes=48 * GIB),
            NodeInfo("c1", "", True, 8, 8, 0, 0, memory_bytes=16 * GIB),
        ]
    )
    spec = JobSpec.model_validate(
        {**small({}).model_dump(mode="json"), "resources": {"cpus_per_worker": 2}}
    )
    assert device_memory(spec, cpus)[0] == 4 * GIB


def _fit_spec(**parallel: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "fit",
            "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
            "data": {"kind": "passkey", "seq_len": 65536},
            "parallel": {"ring_size": "auto", **parallel},
            "train": {"batch_size": parallel.get("data_parallel", 1)},
        }
    )


def _total(spec: JobSpec, ring: int, knobs: dict[str, Any]) -> int:
    shaped = spec.model_copy(
        update={
            "parallel": spec.parallel.model_copy(update={"ring_size": ring}),
            "train": spec.train.model_copy(update=knobs),
        }
    )
    return int(memory_estimate(shaped, "cpu")["total_bytes"])


FULL = {"activation_checkpointing": "full", "tiled_mlp": "off", "offload_activations": False}
FULL_TILED = {**FULL, "tiled_mlp": "auto"}


def test_a_budget_equal_to_the_estimate_fits() -> None:
    """The budget is a bound to stay within: an estimate exactly at it fits. At ring 1 only full+tiled
    (the leanest set on CPU) comes down to the budget, so fit answers ring 1 with it, not ring 2."""
    spec = _fit_spec()
    budget = _total(spec, 1, FULL_TILED)
    assert _total(spec, 1, FULL) > budget  # the bracket this test relies on
    f = fit(spec, _cpu_cluster(2, 8, 64), budget)
    assert (
        f.fits and (f.ring_size, f.ulysses_size) == (1, 1) and f.knobs == MemoryKnobs(**FULL_TILED)
    )


def test_data_parallel_replicas_count_against_the_clusters_devices() -> None:
    """data_parallel 2 on 8 devices leaves sequence groups of at most 4: when only a ring of 8 fits the
    budget, nothing fits within the cluster and the answer says 16 devices would do."""
    spec = _fit_spec(data_parallel=2)
    budget = (_total(spec, 4, FULL_TILED) + _total(spec, 8, FULL_TILED)) // 2
    assert _total(spec, 8, FULL_TILED) <= budget < _total(spec, 4, FULL_TILED)
    f = fit(spec, _cpu_cluster(1, 8, 64), budget)
    assert not f.fits and f.ring_size == 4
    assert "16 devices" in f.message and "the cluster has 8" in f.message, f.message


def test_tensor_parallelism_up_to_a_whole_node() -> None:
    """Nodes of 2 GPUs: tensor_size 2 fills a node and is tried. The wide model (d_model 4096: two
    gathered blocks exceed the budget at any ring) fits only with its blocks split in two."""
    spec = JobSpec.model_validate(
        {
            "name": "wide",
            "model": {"d_model": 4096, "n_layers": 2, "n_heads": 32, "n_kv_heads": 8},
            "data": {"kind": "passkey", "seq_len": 4096},
            "parallel": {"ring_size": "auto"},
            "resources": {"accelerator": "gpu"},
        }
    )
    lean = {**FULL_TILED, "offload_activations": True}

    def shaped(ring: int, tensor: int) -> int:
        parallel = spec.parallel.model_copy(update={"ring_size": ring, "tensor_size": tensor})
        candidate = spec.model_copy(
            update={"parallel": parallel, "train": spec.train.model_copy(update=lean)}
        )
        return int(memory_estimate(candidate, "gpu")["total_bytes"])

    budget = (min(shaped(r, 1) for r in (1, 2, 4, 8)) + shaped(4, 2)) // 2
    assert shaped(4, 2) < budget < min(shaped(r, 1) for r in (1, 2, 4, 8))
    cluster = ClusterInfo(
        [NodeInfo(f"g{i}", "", True, 8, 8, 2, 2, gpu_memory_bytes=80 * GIB) for i in range(4)]
    )
    f = fit(spec, cluster, budget)
    assert f.fits and f.tensor_size == 2, f.message


def _cpu_job(ring: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "place",
            "model": MODEL,
            "data": {"kind": "passkey", "seq_len": 1024},
            "parallel": {"ring_size": ring},
            "resources": {"accelerator": "cpu"},
        }
    )


def test_preview_lands_on_the_node_with_the_most_free_room() -> None:
    """Two 8-CPU nodes, 2 and 6 CPUs free: a 2-rank job (STRICT_PACK, either node holds it) is previewed
    on the second, the one with the most free room, and nothing says it must wait."""
    cluster = ClusterInfo(
        [NodeInfo("n0", "", True, 8, 2, 0, 0), NodeInfo("n1", "", True, 8, 6, 0, 0)]
    )
    p = plan(_cpu_job(2), cluster)
    assert p.fits and p.strategy == "STRICT_PACK"
    assert [s.node_id for s in p.placement] == ["n1", "n1"]


def test_a_job_that_exactly_fits_the_free_room_is_previewed_there_without_a_wait_warning() -> None:
    """n0 (4 CPUs) is busy, n1 has exactly the 4 free CPUs a 4-rank job needs: it lands on n1 now (not
    on the whole cluster's first node) and no 'free now' warning is given."""
    cluster = ClusterInfo(
        [NodeInfo("n0", "", True, 4, 0, 0, 0), NodeInfo("n1", "", True, 4, 4, 0, 0)]
    )
    p = plan(_cpu_job(4), cluster)
    assert p.fits and [s.node_id for s in p.placement] == ["n1"] * 4
    assert not any("free now" in w for w in p.warnings), p.warnings
