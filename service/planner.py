"""Dry-run planning of a job spec against a cluster snapshot: placement preview and memory estimate.

Nothing is reserved. The placement simulation mirrors what the driver does (SPEC §4): one bundle per
rank; STRICT_PACK when the whole job fits one node, else PACK (fill the nodes with the most free
capacity first); ranks are then ordered node by node, device id ascending, and the number of ring
edges that cross a node boundary is counted per ring.

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
    ring_buffers= a·T·2·d_kv·2                    (K and V blocks: the one computed + the one in flight)

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
own count in tests/test_sharding.py; the totals with measured peaks of every knob in tests/test_memory_plan.py
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
from workers.config import JobSpec, mlp_tiles, rope_coverage_warning, ulysses_heads_problem


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

# Measured on CPU (bench/memory.py --breakdown, BENCHMARKS.md "Memory per token"): the resident size of a rank
# before its step beyond its training state: interpreter, torch, gloo, the data source.
CPU_RUNTIME_BYTES = 330 * 10**6
CPU_RUNTIME_HF_BYTES = 100 * 10**6  # a pretrained model's process also holds transformers' modules (measured)
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
    m, tr = spec.model, spec.train
    d, kvd, f, h, L = m.d_model, m.kv_heads * m.head_dim, m.ffn_hidden, m.n_heads, m.n_layers
    qd = m.n_heads * m.head_dim
    mlp = 4 * f  # SwiGLU's gate, up, SiLU and product
    rest = 6 * d + 2 * qd + 2 * kvd + h  # norms, q/k/v/out, lse, residual sums
    tiled = tr.tiled_mlp != "off"
    mode = tr.activation_checkpointing
    terms = {"kept": 0, "working": 0, "working_tile": mlp if tiled else 0, "offloaded": 0}
    block_mlp = 0 if tiled else mlp  # per-token MLP floats of a block's saved set
    if mode == "full":
        terms["kept"] = L * d
        # one block recomputed in backward: its MLP set whole, its attention side about half (the backward
        # frees saved tensors as it consumes them; fitted on the measured marginal bytes per token)
        terms["working"] += rest // 2 + block_mlp
        if tr.offload_activations:
            terms["offloaded"] = (L - 2) * d if L > 2 else 0  # two block inputs in flight stay on the device
    elif mode == "selective":
        terms["kept"] = L * rest  # attention's set; the MLP keeps only its input (in `rest`)
        terms["working"] += block_mlp  # one MLP recomputed in backward
    else:
        terms["kept"] = L * (rest + block_mlp)
    terms["kept"] += 2 * d + m.head_dim  # embedding output, final norm's input, RoPE tables
    return terms


def memory_estimate(spec: JobSpec, accelerator: str | None = None) -> dict[str, Any]:
    """A rank's peak bytes (what `mem_peak_bytes` measures) and its parts; see the module docstring.

    `accelerator`: "cpu" or "gpu" (default: the spec's `resources.accelerator`, auto counting as cpu)."""
    m, p = spec.model, spec.parallel
    acc = accelerator or ("gpu" if spec.resources.accelerator == "gpu" else "cpu")
    P = param_count(spec)
    ulysses = p.ulysses_size
    W = p.data_parallel * p.ring_size * ulysses
    b = spec.train.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * ulysses)
    d, kvd, V = m.d_model, m.kv_heads * m.head_dim, m.vocab_size
    p_block = block_param_count(spec)
    p_root = P - m.n_layers * p_block
    # CUDA: bf16 activations and gathered parameters (fp32 master shards, grads reduced in fp32)
    act_bytes, gathered_bytes = (2, 2) if acc == "gpu" else (4, 4)
    terms = activation_terms(spec)
    tokens = b * t
    tile = _tile_tokens(spec, tokens)
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    parts = {
        "runtime": (CPU_RUNTIME_BYTES + (CPU_RUNTIME_HF_BYTES if m.kind == "hf" else 0)) if acc == "cpu" else 0,
        "params": 4 * P // W,
        "grads": 4 * P // W,
        "adamw": 8 * P // W,
        "gathered": gathered_bytes * (p_root + 2 * p_block) + 4 * (p_root + p_block),  # 2 blocks, fp32 grads
        "activations": act_bytes * tokens * (terms["kept"] - terms["offloaded"]),
        "backward_working_set": act_bytes * (tokens * terms["working"] + tile * terms["working_tile"]),
        "loss": 4 * (2 * chunk * V + V * d + 2 * tokens * d),
        "ring_buffers": act_bytes * tokens * 2 * kvd * 2,
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
        "formula": "runtime (CPU: interpreter, torch, gloo) + 16·P/W (params, grads, AdamW: sharded over all W "
        "ranks) + gathered by FSDP (two blocks and the root, their fp32 grads) + activations kept for backward "
        "(per train.activation_checkpointing / tiled_mlp / offload_activations) + the backward's working set "
        "(one block recomputed and its gradients; the MLP's part per tile when tiled) + chunked loss + ring "
        "K/V buffers; b = batch/data_parallel, t = seq_len/(ring_size·ulysses_size); bytes per activation 4 "
        "on CPU, 2 on CUDA (bf16)",
    }


def _accelerator(spec: JobSpec, cluster: ClusterInfo) -> str:
    acc = spec.resources.accelerator
    if acc == "auto":
        return "gpu" if any(n.gpus_total > 0 for n in cluster.nodes if n.alive) else "cpu"
    return acc


def _capacity(n: NodeInfo, bundle: dict[str, float], free: bool) -> int:
    cpus = n.cpus_free if free else n.cpus_total
    gpus = n.gpus_free if free else n.gpus_total
    k = int(cpus // bundle["CPU"]) if bundle["CPU"] > 0 else 10**9
    if "GPU" in bundle:
        k = min(k, int(gpus // bundle["GPU"]))
    return max(k, 0)


def suggest_split(spec: JobSpec, nodes: list[NodeInfo]) -> dict[str, int] | None:
    """Ulysses × ring for one replica's ring_size × ulysses_size ranks: the largest Ulysses group that fits inside
    a node (its all-to-all is latency-bound), divides the sequence group and suits the heads; the ring covers the
    rest across nodes. None when the model's heads are unknown."""
    m, p = spec.model, spec.parallel
    if not m.shape_known:
        return None
    group = p.ring_size * p.ulysses_size
    per_node = max((int(n.gpus_total) for n in nodes), default=0)
    best = 1
    for u in range(1, group + 1):
        if group % u == 0 and u <= per_node and ulysses_heads_problem(m, u) is None:
            best = u
    return {"ulysses_size": best, "ring_size": group // best}


def plan(spec: JobSpec, cluster: ClusterInfo) -> Plan:
    acc = _accelerator(spec, cluster)
    bundle: dict[str, float] = {"CPU": spec.resources.cpus_per_worker}
    if acc == "gpu":
        bundle["GPU"] = 1.0
    W, U = spec.world_size, spec.parallel.ulysses_size
    R = spec.parallel.ring_size * U  # one replica's sequence group: contiguous ranks, Ulysses innermost
    nodes = [n for n in cluster.nodes if n.alive]
    out = Plan(
        fits=False, accelerator=acc, strategy="STRICT_PACK", world_size=W, bundle=bundle, memory=memory_estimate(spec)
    )
    total = sum(_capacity(n, bundle, free=False) for n in nodes)
    free = sum(_capacity(n, bundle, free=True) for n in nodes)
    need = "GPUs" if acc == "gpu" else f"bundles of {bundle['CPU']:g} CPU"
    if warning := rope_coverage_warning(spec):
        out.warnings.append(warning)
    if not nodes:
        out.warnings.append("the cluster reports no alive nodes; placement cannot be previewed")
        return out
    if total < W:
        out.warnings.append(
            f"the job needs {W} {need} (ring_size {spec.parallel.ring_size} × ulysses_size {U} × data_parallel "
            f"{spec.parallel.data_parallel})"
            f" but the whole cluster has {total}: it can never be placed"
        )
        return out
    if free < W:
        out.warnings.append(
            f"only {free} of the {W} {need} are free now: the job waits QUEUED, holding nothing, until they are"
        )
    use_free = free >= W
    caps = sorted(((_capacity(n, bundle, free=use_free), n) for n in nodes), key=lambda x: (-x[0], x[1].node_id))
    if caps[0][0] >= W:
        caps = [caps[0]]
    else:
        out.strategy = "PACK"
    slots: list[tuple[str, int]] = []
    for cap, n in caps:
        take = min(cap, W - len(slots))
        slots += [(n.node_id, i) for i in range(take)]
        if len(slots) == W:
            break
    out.fits = True
    out.nodes_used = len({nid for nid, _ in slots})
    for rank, (nid, dev) in enumerate(slots):
        out.placement.append(
            RankSlot(rank=rank, ring=rank // R, node_id=nid, device=f"cuda:{dev}" if acc == "gpu" else "cpu")
        )
    for ring in range(W // R):
        members = out.placement[ring * R : (ring + 1) * R]
        if R > 1:
            out.node_crossings += sum(members[i].node_id != members[(i + 1) % R].node_id for i in range(R))
    if acc == "gpu" and (split := suggest_split(spec, nodes)) is not None:
        out.suggested_parallel = split
        if split != {"ulysses_size": U, "ring_size": spec.parallel.ring_size}:
            out.warnings.append(
                f"suggested for this cluster: ulysses_size {split['ulysses_size']} × ring_size {split['ring_size']} "
                "(the all-to-all inside a node, the ring across nodes)"
            )
    if acc == "cpu" and spec.resources.accelerator == "auto" and W > 1:
        out.warnings.append("no GPUs in the cluster: ranks run on CPU with gloo (fine for demos, slow to train)")
    mem = out.memory["total_bytes"]
    if acc == "gpu" and mem > 80 * 2**30:
        out.warnings.append(
            f"estimated {mem / 2**30:.1f} GiB per rank exceeds an 80 GiB GPU: raise ring_size or "
            "enable train.activation_checkpointing"
        )
    return out
