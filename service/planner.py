"""Dry-run planning of a job spec against a cluster snapshot: placement preview and memory estimate.

Nothing is reserved. The preview applies the driver's own rules (`workers.parallel_dims`): the
accelerator `auto` resolves to, one bundle per rank and how many fit each node, STRICT_PACK when one
node's total resources hold the whole job (previewed on the one of those with the most free room),
else PACK (the nodes with the most room first); where the bundles land, ranks are ordered by
`order_ranks`, as the driver orders them, and the hops that cross a node boundary are counted per
sequence group.

Memory per rank (bytes, fp32 everywhere — an upper bound for bf16 runs). The training state is sharded by
FSDP over all W = data_parallel × ring_size × ulysses_size ranks; a block's parameters are gathered whole
only while it runs (the one running and the one prefetched), the root's (embedding, head, final norm) for
the whole step:

    state       = 16·P / W                              (fp32 param, grad, AdamW exp_avg + exp_avg_sq shards)
    gathered    = 4·(2·P_root + 3·P_block)              (root params + grads, two blocks + one block's grad)
    activations = 4·b·t·[L·(6·d + 2·d_q + 2·d_kv + 4·f + h) + 2·d + e]      without activation checkpointing
                  4·b·t·[L·d + (6·d + 2·d_q + 2·d_kv + 4·f + h) + 2·d + e] with (block inputs kept, one recomputed)
    loss        = 4·(2·c·V + V·d + 2·b·t·d)             (chunked: one chunk's logits + softmax, the head's
                                                         fp32 gradient sum, hidden states and their gradient)
    ring_buffers= 4·b·t·2·d_kv·2                        (K and V blocks: the one computed + the one in flight)

with b = batch_size / data_parallel sequences, t = seq_len / (ring_size · ulysses_size) local tokens, L
layers, d = d_model, d_q = n_heads·head_dim, d_kv = n_kv_heads·head_dim, f = SwiGLU hidden, h = n_heads
(log-sum-exp per head), e = head_dim (the RoPE tables; 2·d: the embedding output and the final norm's),
V = vocab, c = min(LOSS_CHUNK_TOKENS, b·t) tokens per loss chunk. A block keeps, per token: two RMSNorm
outputs and their weighted copies (4·d), q, k, v and the attention output (2·d_q + 2·d_kv), its log-sum-exp (h),
the two residual sums (2·d) and SwiGLU's gate, up, SiLU and product (4·f): what autograd saves for the backward
in `workers.models.llama.Block`, compared with autograd's own count in tests/test_sharding.py.
bench/fsdp_memory.py compares the total with measured per-rank peaks (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from workers.config import JobSpec, rope_coverage_warning, ulysses_heads_problem
from workers.parallel_dims import (
    STRICT_PACK,
    ParallelDims,
    WorkerLocation,
    bundles_per_node,
    choose_strategy,
    node_crossings,
    rank_bundle,
    resolve_accelerator,
)


@dataclass
class RankSlot:
    rank: int
    ring: int
    node_id: str
    device: str


@dataclass
class Plan:
    fits: bool
    accelerator: str
    strategy: str
    world_size: int
    bundle: dict[str, float]
    placement: list[RankSlot] = field(default_factory=list)
    node_crossings: int = 0
    nodes_used: int = 0
    memory: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    suggested_parallel: dict[str, int] | None = None  # Ulysses × ring for this cluster's GPUs per node


def block_param_count(spec: JobSpec) -> int:
    """Parameters of one transformer block: q/o, k/v (head_dim may differ from d_model/n_heads), MLP, norms."""
    m = spec.model
    d, qd, kvd, f = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_hidden
    return 2 * d * qd + 2 * d * kvd + 3 * d * f + 2 * d


def param_count(spec: JobSpec) -> int:
    m = spec.model
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return m.n_layers * block_param_count(spec) + emb + m.d_model


LOSS_CHUNK_TOKENS = 4096  # workers.training.loss.DEFAULT_CHUNK_TOKENS (service does not import the trainer)


def memory_estimate(spec: JobSpec) -> dict[str, Any]:
    m, p = spec.model, spec.parallel
    P = param_count(spec)
    ulysses = p.ulysses_size
    W = p.data_parallel * p.ring_size * ulysses
    b = spec.train.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * ulysses)
    d, kvd, f, h, V, L = m.d_model, m.kv_heads * m.head_dim, m.ffn_hidden, m.n_heads, m.vocab_size, m.n_layers
    qd = m.n_heads * m.head_dim
    p_block = block_param_count(spec)
    p_root = P - L * p_block
    per_layer = 6 * d + 2 * qd + 2 * kvd + 4 * f + h
    kept_layers = d * L + per_layer if spec.train.activation_checkpointing else L * per_layer
    kept_layers += 2 * d + m.head_dim
    act = 4 * b * t * kept_layers
    chunk = min(LOSS_CHUNK_TOKENS, b * t)
    parts = {
        "params": 4 * P // W,
        "grads": 4 * P // W,
        "adamw": 8 * P // W,
        "gathered": 4 * (2 * p_root + 3 * p_block),
        "activations": act,
        "loss": 4 * (2 * chunk * V + V * d + 2 * b * t * d),
        "ring_buffers": 4 * b * t * 2 * kvd * 2,
    }
    return {
        "param_count": P,
        "world_size": W,
        "local_tokens": t,
        "local_batch": b,
        "bytes": parts,
        "total_bytes": sum(parts.values()),
        "formula": "16·P/W (params, grads, AdamW: sharded over all W ranks) + 4·(2·P_root + 3·P_block) (gathered "
        "by FSDP) + 4·b·t·[L·(6d + 2d_q + 2d_kv + 4f + h) + 2d + head_dim] (activations; L·d + one layer with "
        "activation checkpointing) "
        "+ 4·(2·c·V + V·d + 2·b·t·d) (chunked loss, c ≤ 4096 tokens) + 16·b·t·d_kv (ring K/V buffers); fp32, "
        "b = batch/data_parallel, t = seq_len/(ring_size·ulysses_size)",
    }


def node_resources(node: NodeInfo, *, free: bool) -> dict[str, float]:
    """A node's free or total resources in Ray's terms (what `bundles_per_node` reads)."""
    if free:
        return {"CPU": node.cpus_free, "GPU": node.gpus_free}
    return {"CPU": node.cpus_total, "GPU": node.gpus_total}


def preview_landing(
    world_size: int,
    bundle: dict[str, float],
    nodes: list[NodeInfo],
) -> tuple[str, list[str]]:
    """(strategy, node id of each bundle): where a job that fits the cluster likely lands."""
    totals = [node_resources(n, free=False) for n in nodes]
    strategy = choose_strategy(world_size, bundle, totals)
    free_room = sum(bundles_per_node(bundle, node_resources(n, free=True)) for n in nodes)
    use_free = free_room >= world_size  # else the job waits: preview it on the whole cluster
    candidates = nodes
    if strategy == STRICT_PACK:
        holds_all = [bundles_per_node(bundle, total) >= world_size for total in totals]
        candidates = [n for n, whole in zip(nodes, holds_all, strict=True) if whole]
    rooms = []
    for n in candidates:
        rooms.append((bundles_per_node(bundle, node_resources(n, free=use_free)), n.node_id))
    rooms.sort(key=lambda room: (-room[0], room[1]))
    if strategy == STRICT_PACK:
        return strategy, [rooms[0][1]] * world_size
    landing: list[str] = []
    for room, node_id in rooms:
        landing += [node_id] * min(room, world_size - len(landing))
        if len(landing) == world_size:
            break
    return strategy, landing


def suggest_split(spec: JobSpec, nodes: list[NodeInfo]) -> dict[str, int] | None:
    """Ulysses × ring for one replica's ring_size × ulysses_size ranks: the largest Ulysses group that fits inside
    a node (its all-to-all is latency-bound), divides the sequence group and suits the heads; the ring covers the
    rest across nodes. None when the model's heads are unknown."""
    m = spec.model
    if not m.shape_known:
        return None
    group = ParallelDims.of(spec.parallel).seq_group_size
    per_node = max((int(n.gpus_total) for n in nodes), default=0)
    best = 1
    for u in range(1, group + 1):
        if group % u == 0 and u <= per_node and ulysses_heads_problem(m, u) is None:
            best = u
    return {"ulysses_size": best, "ring_size": group // best}


def plan(spec: JobSpec, cluster: ClusterInfo) -> Plan:
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    bundle = rank_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    dims = ParallelDims.of(spec.parallel)
    world, ulysses = dims.world_size, dims.ulysses_size
    out = Plan(
        fits=False,
        accelerator=acc,
        strategy=STRICT_PACK,
        world_size=world,
        bundle=bundle,
        memory=memory_estimate(spec),
    )
    total = sum(bundles_per_node(bundle, node_resources(n, free=False)) for n in nodes)
    free = sum(bundles_per_node(bundle, node_resources(n, free=True)) for n in nodes)
    need = "GPUs" if acc == "gpu" else f"bundles of {bundle['CPU']:g} CPU"
    if warning := rope_coverage_warning(spec):
        out.warnings.append(warning)
    if not nodes:
        out.warnings.append("the cluster reports no alive nodes; placement cannot be previewed")
        return out
    if total < world:
        out.warnings.append(
            f"the job needs {world} {need} (ring_size {spec.parallel.ring_size} "
            f"× ulysses_size {ulysses} × data_parallel {spec.parallel.data_parallel}) "
            f"but the whole cluster has {total}: it can never be placed"
        )
        return out
    if free < world:
        waits = "the job waits QUEUED, holding nothing, until they are"
        out.warnings.append(f"only {free} of the {world} {need} are free now: {waits}")
    out.strategy, landing = preview_landing(world, bundle, nodes)
    # One actor per bundle, GPU ids counted per node: then the driver's own rank order.
    per_node: dict[str, int] = {}
    locations = []
    for node_id in landing:
        device_index = per_node.get(node_id, 0)
        per_node[node_id] = device_index + 1
        locations.append(WorkerLocation(node_id, "", (str(device_index),) if acc == "gpu" else ()))
    assignments = dims.order_ranks(locations)
    out.fits = True
    out.nodes_used = len(per_node)
    for a in assignments:
        slot = RankSlot(rank=a.rank, ring=a.replica, node_id=a.node_id, device=a.device)
        out.placement.append(slot)
    out.node_crossings = node_crossings(assignments, dims.seq_group_size)
    if acc == "gpu" and (split := suggest_split(spec, nodes)) is not None:
        out.suggested_parallel = split
        if split != {"ulysses_size": ulysses, "ring_size": spec.parallel.ring_size}:
            out.warnings.append(
                f"suggested for this cluster: ulysses_size {split['ulysses_size']} × ring_size "
                f"{split['ring_size']} (the all-to-all inside a node, the ring across nodes)"
            )
    if acc == "cpu" and spec.resources.accelerator == "auto" and world > 1:
        on_cpu = "ranks run on CPU with gloo (fine for demos, slow to train)"
        out.warnings.append(f"no GPUs in the cluster: {on_cpu}")
    mem = out.memory["total_bytes"]
    if acc == "gpu" and mem > 80 * 2**30:
        out.warnings.append(
            f"estimated {mem / 2**30:.1f} GiB per rank exceeds an 80 GiB GPU: raise ring_size or "
            "enable train.activation_checkpointing"
        )
    return out
