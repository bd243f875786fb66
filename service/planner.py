"""Dry-run planning of a job spec against a cluster snapshot: placement preview and memory estimate.

Nothing is reserved. The preview applies the driver's own rules (`workers.parallel_dims`): the
accelerator `auto` resolves to, one bundle per rank and how many fit each node, STRICT_PACK when one
node's total resources hold the whole job (previewed on the one of those with the most free room),
else PACK (the nodes with the most room first); where the bundles land, ranks are ordered by
`order_ranks`, as the driver orders them, and the hops that cross a node boundary are counted along
each ring (`ParallelDims.node_crossings`, as the driver counts them).

Memory per rank (bytes): what a rank reports as `mem_peak_bytes`. The training state is sharded by FSDP
over all W = data_parallel × ring_size × ulysses_size ranks; a block's parameters are gathered whole only
while it runs (the one running and the one prefetched), the root's (embedding, head, final norm) for the
whole step. With a = bytes per activation (4 on CPU; 2 on CUDA, bf16 under autocast) and T = b·t:

    runtime     = CPU_RUNTIME_BYTES on CPU (interpreter, torch, gloo: measured), 0 on CUDA
    state       = 16·P / W                        (fp32 param, grad, AdamW exp_avg + exp_avg_sq shards)
    gathered    = a·(P_root + 2·P_block) + 4·(P_root + P_block)   (two blocks and the root, fp32 grads)
    activations = a·T·kept                        (what autograd keeps from forward to backward)
    backward    = a·(T·working + tile·working_tile)  (one block recomputed and back-propagated)
    loss        = 4·(2·c·V + V·d + 2·T·d)         (chunked: one chunk's logits + softmax, the head's
                                                   fp32 gradient sum, hidden states and their gradient)
    ring_buffers= T·(2·d_kv/G)·2·(a + 4)          (ring > 1: one K/V-head chunk's K and V, held and in
                                                   flight, and their fp32 dK/dV, travelling and arriving;
                                                   G = `ring_head_chunks`)

and, per token, with blk = 6·d + 2·d_q + 2·d_kv + h (norm outputs and weighted copies, q/k/v/out, lse,
residual sums) and mlp = 4·f (SwiGLU's gate, up, SiLU, product; 0 inside `blk` when tiled):

    activation_checkpointing  kept                      working
    none                      L·(blk + mlp)             0
    selective                 L·blk                     mlp
    full                      L·d                       blk/2 + mlp
    (+ 2·d + e in every case: embedding output, final norm's input, RoPE tables)

With `tiled_mlp`, mlp leaves both columns and costs `working_tile` = mlp per token of one tile
(`tile` = T / `mlp_tiles`). With `offload_activations` (CUDA), (L − 2)·d of `kept` is in host memory.
b = batch_size / data_parallel sequences, t = seq_len / (ring_size · ulysses_size) local tokens, L layers,
d = d_model, d_q = n_heads·head_dim, d_kv = n_kv_heads·head_dim, f = SwiGLU hidden, h = n_heads, e =
head_dim, V = vocab, c = min(LOSS_CHUNK_TOKENS, T). `kept` without checkpointing is compared with autograd's
own count in tests/unit/workers/training/test_sharding.py; the totals with measured peaks of every
knob in tests/integration/test_memory_plan.py
and bench/memory.py (BENCHMARKS.md, "Memory per token"). CUDA terms (bf16 activations and gathered
parameters, fp32 master shards) follow the code and are unmeasured: the caching allocator's reserve beyond
live tensors, NCCL's buffers and the pinned host memory of offload are not in `max_memory_allocated`, so
not in the estimate either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from workers.config import (
    MAX_WORLD,
    JobSpec,
    mlp_tiles,
    rope_coverage_warning,
    tensor_heads_problem,
    ulysses_heads_problem,
)
from workers.parallel_dims import (
    STRICT_PACK,
    ParallelDims,
    WorkerLocation,
    bundles_per_node,
    choose_strategy,
    rank_bundle,
    resolve_accelerator,
    ring_head_chunks,
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
    suggested_parallel: dict[str, int] | None = (
        None  # Ulysses × ring for this cluster's GPUs per node
    )


def block_param_count(spec: JobSpec) -> int:
    """Parameters of one transformer block: q/o, k/v (head_dim may differ from d_model/n_heads), MLP, norms."""
    return _projection_params(spec) + 2 * spec.model.d_model


def _projection_params(spec: JobSpec) -> int:
    """A block's projections (q, k, v, o, gate, up, down): what tensor parallelism splits."""
    m = spec.model
    d, qd, kvd, f = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_hidden
    return 2 * d * qd + 2 * d * kvd + 3 * d * f


def local_block_param_count(spec: JobSpec) -> int:
    """A block's parameters on one tensor rank: 1/tensor_size of the projections, all the norms."""
    return _projection_params(spec) // spec.parallel.tensor_size + 2 * spec.model.d_model


def param_count(spec: JobSpec) -> int:
    m = spec.model
    emb = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return m.n_layers * block_param_count(spec) + emb + m.d_model


LOSS_CHUNK_TOKENS = (
    4096  # workers.training.loss.DEFAULT_CHUNK_TOKENS (service does not import the trainer)
)

# Measured on CPU (bench/memory.py --breakdown, BENCHMARKS.md "Memory per token"): the resident size of a rank
# before its step beyond its training state: interpreter, torch, gloo, the data source. A torchrun rank
# holds ~330 MB; a rank started from a larger parent (multiprocessing spawn, as the tests' ranks are, or
# a Ray worker) 30-70 MB more (tests/integration/test_memory_plan.py): the middle, so a fit errs on the
# side of fitting.
CPU_RUNTIME_BYTES = 360 * 10**6
# A tensor-parallel rank also holds its tensor group's gloo context and DTensor's dispatch caches, and
# the gathers and reduce-scatters around each block make fresh tensors: measured 30-70 MB more than the
# terms below on CPU (tests/integration/test_memory_plan.py, ring 1 and 2 x tensor_size 2).
CPU_RUNTIME_TP_BYTES = 40 * 10**6
# A model kind's own share (a pretrained model's process also holds transformers' modules) is its
# config class's `cpu_runtime_bytes` (`workers/config/`).
# The backward's own temporaries (gradients of the residual stream, of q/k/v and of the MLP) fit, measured,
# in what the backward frees as it consumes saved tensors: bench/memory.py, BENCHMARKS.md "Memory per token".


def _tile_tokens(spec: JobSpec, local_tokens: int) -> int:
    """Tokens of one MLP tile (`mlp_tiles`): the MLP's working set exists for this many tokens at a time."""
    tiles = mlp_tiles(spec.train.tiled_mlp, local_tokens, spec.model.d_model)
    return math.ceil(local_tokens / tiles)


def activation_terms(spec: JobSpec) -> dict[str, int]:
    """Floats per local token (and per tile token) that the knobs decide, for one rank.

    kept      what autograd keeps from forward to backward, per token, over all layers;
    working   the largest set alive while one block is (recomputed and) back-propagated, per token,
              plus `working_tile` per tile token (the MLP's part when it is tiled);
    offloaded the part of `kept` held in host memory instead (offload_activations)."""
    m, tr, T = spec.model, spec.train, spec.parallel.tensor_size
    # a tensor rank holds 1/T of the heads and MLP columns (and 1/T of the residual stream, below)
    kvd, f, h = m.kv_heads * m.head_dim // T, m.ffn_hidden // T, m.n_heads // T
    d, L = m.d_model, m.n_layers
    qd = m.n_heads * m.head_dim // T
    mlp = 4 * f  # SwiGLU's gate, up, SiLU and product
    # norms, q/k/v/out, lse, residual sums; under tensor parallelism the residual stream, the norms
    # and the projections' outputs are a rank's piece of the sequence (1/T), the inputs the attention
    # and the MLP gather are whole
    # (the two norms' normalised inputs are among the pieces only where the norm keeps them)
    pieces = 4 if m.norm_keeps_normalized else 2
    rest = 2 * d + pieces * d // T + 2 * qd + 2 * kvd + h
    tiled = tr.tiled_mlp != "off"
    mode = tr.activation_checkpointing
    terms = {"kept": 0, "working": 0, "working_tile": mlp if tiled else 0, "offloaded": 0}
    block_mlp = 0 if tiled else mlp  # per-token MLP floats of a block's saved set
    if mode == "full":
        terms["kept"] = L * d // T  # one input per block: a rank's piece of the sequence
        # one block recomputed in backward: its MLP set whole, its attention side about half (the backward
        # frees saved tensors as it consumes them; fitted on the measured marginal bytes per token)
        terms["working"] += rest // 2 + block_mlp
        if tr.offload_activations:
            terms["offloaded"] = (
                (L - 2) * d if L > 2 else 0
            )  # two block inputs in flight stay on the device
    elif mode == "selective":
        terms["kept"] = L * rest  # attention's set; the MLP keeps only its input (in `rest`)
        terms["working"] += block_mlp  # one MLP recomputed in backward
    else:
        terms["kept"] = L * (rest + block_mlp)
    # embedding output, the final norm's input (and its normalised input, where kept), RoPE tables
    terms["kept"] += (2 if m.norm_keeps_normalized else 1) * d + m.head_dim
    return terms


def _ring_buffer_bytes(ring: int, kv_heads: int, kvd: int, tokens: int, act_bytes: int) -> int:
    """The ring backward's buffers at its peak: one K/V-head chunk's K/V held and in flight (activation
    dtype) and its dK/dV travelling and arriving (fp32); nothing travels on a ring of one."""
    if ring == 1:
        return 0
    per_chunk = 2 * kvd // ring_head_chunks(kv_heads, ring)  # K and V floats per token
    return tokens * per_chunk * 2 * (act_bytes + 4)


def memory_estimate(spec: JobSpec, accelerator: str | None = None) -> dict[str, Any]:
    """A rank's peak bytes (what `mem_peak_bytes` measures) and its parts; see the module docstring.

    `accelerator`: "cpu" or "gpu" (default: the spec's `resources.accelerator`, auto counting as cpu)."""
    m, p = spec.model, spec.parallel
    acc = accelerator or ("gpu" if spec.resources.accelerator == "gpu" else "cpu")
    P = param_count(spec)
    ulysses, T = p.ulysses_size, p.tensor_size
    W = p.data_parallel * p.ring_size * ulysses * T
    S = W // T  # FSDP shards over every dimension but the tensor one
    b = spec.train.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * ulysses)
    d, kvd, V = m.d_model, m.kv_heads * m.head_dim // T, m.vocab_size
    p_root = P - m.n_layers * block_param_count(spec)
    p_block = local_block_param_count(spec)
    p_rank = m.n_layers * p_block + p_root  # one tensor rank's share, before FSDP
    # CUDA: bf16 activations and gathered parameters (fp32 master shards, grads reduced in fp32)
    act_bytes, gathered_bytes = (2, 2) if acc == "gpu" else (4, 4)
    terms = activation_terms(spec)
    tokens = b * t
    tile = _tile_tokens(spec, tokens)
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    parts = {
        "runtime": (
            CPU_RUNTIME_BYTES + m.cpu_runtime_bytes + (CPU_RUNTIME_TP_BYTES if T > 1 else 0)
        )
        if acc == "cpu"
        else 0,
        "params": 4 * p_rank // S,
        "grads": 4 * p_rank // S,
        "adamw": 8 * p_rank // S,
        "gathered": gathered_bytes * (p_root + 2 * p_block)
        + 4 * (p_root + p_block),  # 2 blocks, fp32 grads
        "activations": act_bytes * tokens * (terms["kept"] - terms["offloaded"]),
        "backward_working_set": act_bytes
        * (tokens * terms["working"] + tile * terms["working_tile"]),
        "loss": 4 * (2 * chunk * V + V * d + 2 * tokens * d),
        "ring_buffers": _ring_buffer_bytes(p.ring_size, m.kv_heads // T, kvd, tokens, act_bytes),
    }
    return {
        "param_count": P,
        "world_size": W,
        "local_tokens": t,
        "local_batch": b,
        "mlp_tile_tokens": tile,
        "accelerator": acc,
        "offloaded_bytes": act_bytes * tokens * terms["offloaded"],
        "bytes": parts,
        "total_bytes": sum(parts.values()),
        "formula": "runtime (CPU: interpreter, torch, gloo) + 16*P_T/S (params, grads, AdamW: a tensor "
        "rank's share P_T, 1/T of every projection, sharded over the S = W/T ranks of the other "
        "dimensions) + gathered by FSDP (two blocks and the root, their fp32 grads) + activations kept for backward "
        "(per train.activation_checkpointing / tiled_mlp / offload_activations) + the backward's working set "
        "(one block recomputed and its gradients; the MLP's part per tile when tiled) + chunked loss + ring "
        "K/V buffers; b = batch/data_parallel, t = seq_len/(ring_size*ulysses_size); heads, K/V and MLP "
        "columns per rank divided by T = tensor_size; bytes per activation 4 on CPU, 2 on CUDA (bf16)",
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
    world, ulysses, tensor = dims.world_size, dims.ulysses_size, dims.tensor_size
    # capacity in placement bundles: one per rank, or one per tensor group (on one node)
    unit = dims.placement_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    units = dims.placement_units
    out = Plan(
        fits=False,
        accelerator=acc,
        strategy=STRICT_PACK,
        world_size=world,
        bundle=bundle,
        memory=memory_estimate(spec, acc),
    )
    total = tensor * sum(bundles_per_node(unit, node_resources(n, free=False)) for n in nodes)
    free = tensor * sum(bundles_per_node(unit, node_resources(n, free=True)) for n in nodes)
    need = "GPUs" if acc == "gpu" else f"bundles of {bundle['CPU']:g} CPU"
    if tensor > 1:
        need += f" in whole tensor groups of {tensor} per node"
    if warning := rope_coverage_warning(spec):
        out.warnings.append(warning)
    if not nodes:
        out.warnings.append("the cluster reports no alive nodes; placement cannot be previewed")
        return out
    if total < world:
        out.warnings.append(
            f"the job needs {world} {need} ({dims.describe()}) "
            f"but the whole cluster has {total}: it can never be placed"
        )
        return out
    if free < world:
        waits = "the job waits QUEUED, holding nothing, until they are"
        out.warnings.append(f"only {free} of the {world} {need} are free now: {waits}")
    out.strategy, landing = preview_landing(units, unit, nodes)
    # One actor per rank (tensor_size of them per bundle), GPU ids counted per node: then the
    # driver's own rank order.
    per_node: dict[str, int] = {}
    locations = []
    for node_id in (n for n in landing for _ in range(tensor)):
        device_index = per_node.get(node_id, 0)
        per_node[node_id] = device_index + 1
        locations.append(WorkerLocation(node_id, "", (str(device_index),) if acc == "gpu" else ()))
    assignments = dims.order_ranks(locations)
    out.fits = True
    out.nodes_used = len(per_node)
    for a in assignments:
        slot = RankSlot(rank=a.rank, ring=a.ring, node_id=a.node_id, device=a.device)
        out.placement.append(slot)
    out.node_crossings = dims.node_crossings(assignments)
    if acc == "gpu" and (split := suggest_split(spec, nodes)) is not None:
        out.suggested_parallel = split
        if split != {"ulysses_size": ulysses, "ring_size": spec.parallel.ring_size}:
            out.warnings.append(
                f"suggested for this cluster: ulysses_size {split['ulysses_size']} x ring_size "
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


# --- fit: the smallest sequence group and the cheapest knobs whose estimate fits a budget ---------

GIB = 2**30

# Knob sets cheapest first in throughput (BENCHMARKS.md "Cost of each knob": none 1.00, selective
# 0.94, tiled 0.81, full 0.79, full + tiled 0.67); offload (CUDA only, unmeasured) after them.
KNOBS: tuple[dict[str, Any], ...] = (
    {"activation_checkpointing": "none", "tiled_mlp": "off", "offload_activations": False},
    {"activation_checkpointing": "selective", "tiled_mlp": "off", "offload_activations": False},
    {"activation_checkpointing": "none", "tiled_mlp": "auto", "offload_activations": False},
    {"activation_checkpointing": "full", "tiled_mlp": "off", "offload_activations": False},
    {"activation_checkpointing": "full", "tiled_mlp": "auto", "offload_activations": False},
    {"activation_checkpointing": "full", "tiled_mlp": "off", "offload_activations": True},
    {"activation_checkpointing": "full", "tiled_mlp": "auto", "offload_activations": True},
)
MAX_ALTERNATIVES = 24  # the response lists at most this many candidates tried


def knobs_name(knobs: dict[str, Any]) -> str:
    """A knob set in words: 'none', 'selective', 'full+tiled+offload', ..."""
    parts = (
        [] if knobs["activation_checkpointing"] == "none" else [knobs["activation_checkpointing"]]
    )
    parts += ["tiled"] if knobs["tiled_mlp"] != "off" else []
    parts += ["offload"] if knobs["offload_activations"] else []
    return "+".join(parts) or "none"


@dataclass
class Fit:
    """What `fit` chose (fits) or why nothing fits: the best candidate and its shortfall."""

    fits: bool
    memory_per_rank_bytes: int
    accelerator: str
    ring_size: int = 0
    ulysses_size: int = 1
    tensor_size: int = 1
    knobs: dict[str, Any] = field(default_factory=dict)
    spec: JobSpec | None = None  # the spec it would run (fits), or the best candidate
    memory: dict[str, Any] = field(default_factory=dict)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    shortfall_bytes: int = 0
    message: str = ""


def device_memory(spec: JobSpec, cluster: ClusterInfo) -> tuple[int | None, str]:
    """The memory one rank may use on this cluster's devices, and where it came from (or why not).

    GPU jobs: the smallest GPU's memory (`NodeInfo.gpu_memory_bytes`); CPU jobs: a bundle's share of
    its node's memory (node memory / node CPUs x cpus_per_worker), the smallest over the nodes."""
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    if acc == "gpu":
        known = [n.gpu_memory_bytes for n in nodes if n.gpus_total > 0 and n.gpu_memory_bytes > 0]
        if not known:
            return None, "the cluster does not report its GPUs' memory"
        return int(min(known)), "the smallest GPU's memory"
    cpw = spec.resources.cpus_per_worker
    shares = [
        n.memory_bytes / n.cpus_total * cpw for n in nodes if n.memory_bytes > 0 and n.cpus_total
    ]
    if not shares:
        return None, "the cluster does not report its nodes' memory"
    return int(min(shares)), f"a bundle's share of node memory ({cpw:g} CPU per rank)"


def _shape_problem(spec: JobSpec, ring: int, ulysses: int, tensor: int = 1) -> str | None:
    """Why this ring x Ulysses x tensor cannot run the spec's lengths and heads (its own rules)."""
    dims = ParallelDims(ring_size=ring, ulysses_size=ulysses, tensor_size=tensor)
    need = dims.seq_divisor(spec.parallel.layout)
    lengths = [spec.data.seq_len, *(spec.eval.context_lengths or [])]
    lengths += [s.seq_len for s in getattr(spec.data, "curriculum", [])]
    if any(length % need for length in lengths):
        return f"seq_len not divisible by {need}"
    if spec.model.shape_known and (
        tensor_heads_problem(spec.model, tensor)
        or ulysses_heads_problem(spec.model, ulysses, tensor)
    ):
        return "heads"
    return None


def _shapes(spec: JobSpec, group: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(ring, ulysses) for a sequence group of `group` ranks, most Ulysses first: on GPU nodes the
    largest Ulysses group inside a node that the heads allow, then smaller; elsewhere the spec's."""
    u_spec = spec.parallel.ulysses_size
    if gpus_per_node < 1:
        return [(group // u_spec, u_spec)] if group % u_spec == 0 else []
    us = [u for u in range(min(group, gpus_per_node), 0, -1) if group % u == 0]
    return [(group // u, u) for u in us]


def _tensor_sizes(spec: JobSpec, ranks_per_node: int) -> list[int]:
    """Tensor sizes to try, in order: the spec's, then (when it is 1) each larger power of two a
    node holds and the model splits into. A larger T divides the state and the activations per
    rank but adds collectives to every block, so it comes after every sequence group at the
    spec's T (which splits only the activations)."""
    own = spec.parallel.tensor_size
    if own > 1 or not spec.model.shape_known:
        return [own]
    sizes, t = [own], 2
    while t <= ranks_per_node:
        if tensor_heads_problem(spec.model, t) is None:
            sizes.append(t)
        t *= 2
    return sizes


def _with(
    spec: JobSpec, ring: int, ulysses: int, knobs: dict[str, Any], tensor: int | None = None
) -> JobSpec:
    shape = {"ring_size": ring, "ulysses_size": ulysses}
    if tensor is not None:
        shape["tensor_size"] = tensor
    parallel = spec.parallel.model_copy(update=shape)
    train = spec.train.model_copy(update=knobs)
    return spec.model_copy(update={"parallel": parallel, "train": train})


def fit(spec: JobSpec, cluster: ClusterInfo, memory_per_rank_bytes: int | None = None) -> Fit:
    """The spec it would run: the smallest sequence group (ring x Ulysses, data_parallel as given,
    world within the cluster's devices) and, at it, the cheapest knobs whose estimate fits the
    budget (default: `device_memory`); when nothing fits at the spec's tensor_size of 1, larger
    tensor sizes inside a node (`_tensor_sizes`). ValueError when no budget is given and none is
    known."""
    if memory_per_rank_bytes is None:
        memory_per_rank_bytes, why = device_memory(spec, cluster)
        if memory_per_rank_bytes is None:
            raise ValueError(why)
    budget = memory_per_rank_bytes
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    bundle = rank_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    per_node_counts = [bundles_per_node(bundle, node_resources(n, free=False)) for n in nodes]
    devices = sum(per_node_counts)
    dp = spec.parallel.data_parallel
    per_node = max((int(n.gpus_total) for n in nodes), default=0) if acc == "gpu" else 0
    knob_sets = [k for k in KNOBS if acc == "gpu" or not k["offload_activations"]]
    out = Fit(fits=False, memory_per_rank_bytes=budget, accelerator=acc)
    best: tuple[int, JobSpec, dict[str, Any], dict[str, Any]] | None = None

    def row(candidate: JobSpec, knobs: dict[str, Any], total: int) -> dict[str, Any]:
        p = candidate.parallel
        return {
            "ring_size": p.ring_size,
            "ulysses_size": p.ulysses_size,
            "tensor_size": p.tensor_size,
            "knobs": knobs_name(knobs),
            "total_bytes": total,
            "fits": total <= budget,
        }

    tensors = _tensor_sizes(spec, max(per_node_counts, default=0))
    for tensor in tensors:
        # a node holds whole tensor groups only
        room = sum(c // tensor for c in per_node_counts) * tensor if nodes else MAX_WORLD
        max_group = min(room, MAX_WORLD) // (dp * tensor)
        for group in range(1, max_group + 1):
            for ring, ulysses in _shapes(spec, group, per_node // tensor if per_node else 0):
                if _shape_problem(spec, ring, ulysses, tensor):
                    continue
                # the leanest knobs first: when even they exceed, no cheaper set fits this shape
                lean = _with(spec, ring, ulysses, knob_sets[-1], tensor)
                lean_est = memory_estimate(lean, acc)
                lean_total = int(lean_est["total_bytes"])
                if best is None or lean_total < best[0]:
                    best = (lean_total, lean, knob_sets[-1], lean_est)
                if lean_total > budget:
                    if len(out.alternatives) < MAX_ALTERNATIVES:
                        out.alternatives.append(row(lean, knob_sets[-1], lean_total))
                    continue
                for knobs in knob_sets:
                    candidate = _with(spec, ring, ulysses, knobs, tensor)
                    est = memory_estimate(candidate, acc)
                    total = int(est["total_bytes"])
                    out.alternatives.append(row(candidate, knobs, total))
                    if total <= budget:
                        out.alternatives = out.alternatives[-MAX_ALTERNATIVES:]
                        out.fits, out.spec, out.knobs, out.memory = True, candidate, knobs, est
                        out.ring_size, out.ulysses_size = ring, ulysses
                        out.tensor_size = tensor
                        tp = f" x tensor_size {tensor}" if tensor > 1 else ""
                        out.message = (
                            f"ring_size {ring} x ulysses_size {ulysses}{tp} with "
                            f"{knobs_name(knobs)}: {total / GIB:.2f} of {budget / GIB:.2f} GiB per rank"
                        )
                        return out
    # Beyond the cluster (sequence groups doubling, the spec's tensor_size): only to say how many
    # devices would do.
    tensor = tensors[0]
    group = max(min(devices if nodes else MAX_WORLD, MAX_WORLD) // (dp * tensor), 1)
    while nodes and group * 2 * dp * tensor <= MAX_WORLD:
        group *= 2
        for ring, ulysses in _shapes(spec, group, per_node // tensor if per_node else 0):
            if _shape_problem(spec, ring, ulysses, tensor):
                continue
            lean = _with(spec, ring, ulysses, knob_sets[-1], tensor)
            total = int(memory_estimate(lean, acc)["total_bytes"])
            if total <= budget:
                return _short(
                    out,
                    best,
                    budget,
                    group * dp * tensor,
                    devices,
                    row(lean, knob_sets[-1], total),
                )
    return _short(out, best, budget, None, devices, None)


def _short(
    out: Fit,
    best: tuple[int, JobSpec, dict[str, Any], dict[str, Any]] | None,
    budget: int,
    world_needed: int | None,
    devices: int,
    would_fit: dict[str, Any] | None,
) -> Fit:
    """Nothing fits within the cluster: the best candidate, by how much it exceeds, what would do."""
    if best is None:
        out.message = (
            "no ring x Ulysses shape divides the spec's sequence lengths within the cluster"
        )
        return out
    total, candidate, knobs, est = best
    out.spec, out.knobs, out.memory = candidate, knobs, est
    out.ring_size, out.ulysses_size = candidate.parallel.ring_size, candidate.parallel.ulysses_size
    out.tensor_size = candidate.parallel.tensor_size
    out.shortfall_bytes = total - budget
    needed = f"a budget of at least {total / GIB:.2f} GiB per rank"
    if would_fit is not None and world_needed is not None:
        tp = would_fit["tensor_size"]
        needed += (
            f", or {world_needed} devices (ring_size {would_fit['ring_size']} x ulysses_size "
            f"{would_fit['ulysses_size']}" + (f" x tensor_size {tp}" if tp > 1 else "") + " with "
            f"{would_fit['knobs']}; the cluster has {devices})"
        )
    tp_best = f" x tensor_size {out.tensor_size}" if out.tensor_size > 1 else ""
    out.message = (
        f"nothing fits {budget / GIB:.2f} GiB per rank within the cluster's {devices} devices: the "
        f"best candidate (ring_size {out.ring_size} x ulysses_size {out.ulysses_size}{tp_best} with "
        f"{knobs_name(knobs)}) needs {total / GIB:.2f} GiB, {out.shortfall_bytes} bytes "
        f"({out.shortfall_bytes / GIB:.2f} GiB) over; it would need {needed}"
    )
    return out
