"""Memory per rank: parameter counts and the estimate that `plan` reports and `fit` fits.

Memory per rank (bytes): what a rank reports as `mem_peak_bytes`. The training state is sharded by
FSDP over all W = data_parallel × ring_size × ulysses_size ranks; a block's parameters are
gathered whole only while it runs (the one running and the one prefetched), the root's (embedding,
head, final norm) for the whole step. With a = bytes per activation (4 on CPU; 2 on CUDA, bf16 under
autocast) and T = b·t:

    runtime     = CPU_RUNTIME_BYTES on CPU (interpreter, torch, gloo: measured), 0 on CUDA
    state       = 16·P / W                        (fp32 param, grad, AdamW exp_avg +
                                                   exp_avg_sq shards)
    gathered    = a·(P_root + 2·P_block) + 4·(P_root + P_block)
                                                  (two blocks and the root, fp32 grads)
    activations = a·T·kept                        (what autograd keeps from forward to backward)
    backward    = a·(T·working + tile·working_tile)  (one block recomputed and back-propagated)
    loss        = 4·(2·c·V + V·d + 2·T·d)         (chunked: one chunk's logits + softmax, the
                                                   head's fp32 gradient sum, hidden states and
                                                   their gradient)
    ring_buffers= T·(2·d_kv/G)·2·(a + 4)          (ring > 1: one K/V-head chunk's K and V, held
                                                   and in flight, and their fp32 dK/dV,
                                                   travelling and arriving; G = `ring_head_chunks`)

and, per token, with blk = 6·d + 2·d_q + 2·d_kv + h (norm outputs and weighted copies, q/k/v/out,
lse, residual sums) and mlp = 4·f (SwiGLU's gate, up, SiLU, product; 0 inside `blk` when tiled):

    activation_checkpointing  kept                      working
    none                      L·(blk + mlp)             0
    selective                 L·blk                     mlp
    full                      L·d                       blk/2 + mlp
    (+ 2·d + e in every case: embedding output, final norm's input, RoPE tables)

With `tiled_mlp`, mlp leaves both columns and costs `working_tile` = mlp per token of one tile
(`tile` = T / `mlp_tiles`). With `offload_activations` (CUDA), (L − 2)·d of `kept` is in host
memory. b = batch_size / data_parallel sequences, t = seq_len / (ring_size · ulysses_size) local
tokens, L layers, d = d_model, d_q = n_heads·head_dim, d_kv = n_kv_heads·head_dim, f = SwiGLU
hidden, h = n_heads, e = head_dim, V = vocab, c = min(LOSS_CHUNK_TOKENS, T). `kept` without
checkpointing is compared with autograd's own count in tests/unit/workers/training/test_sharding.py;
the totals with measured peaks of every knob in tests/integration/test_memory_plan.py and
bench/memory.py (BENCHMARKS.md, "Memory per token"). CUDA terms (bf16 activations and gathered
parameters, fp32 master shards) follow the code and are unmeasured: the caching allocator's reserve
beyond live tensors, NCCL's buffers and the pinned host memory of offload are not in
`max_memory_allocated`, so not in the estimate either.

Pipeline parallel (`parallel.pipeline_size` P > 1): each pipeline rank r is estimated on its own
(`pipeline_rank_bytes`) and `total_bytes` is the busiest's. Its state is its stages' layers, plus
the embedding with the first stage and the final norm and head with the last, sharded over its
stage's S = D x R x U ranks (not sharded under zero_bubble, whose stages run without FSDP, and
then nothing is gathered); the chunked loss is the last stage's. Every token count above is one
microbatch's (b / M rows); the activations are those of the microbatch-stages the rank's schedule
holds at once, each with its own stage's layers, found by walking the rank's order of work as
torch.distributed.pipelining builds it (`schedule_ops`; V = 2 stages per rank, m_r = M / max(1,
M // P) microbatches per round):

    1f1b               min(M, P - r) forwards before the first backward
    interleaved_1f1b   (V - 1)·m_r + 2·(P - 1 - r) forwards, then forward-backward pairs
    zero_bubble        (V - 1)·m_r + (P - 1 - r) forwards; a microbatch-stage is freed only by its
                       deferred weight gradient, and from its input backward on it also holds its
                       weights' output gradients (q, k, v, o, gate, up, down, both norms)

plus torch's receive buffers, one per microbatch (M): a stage's input (all but the first) and its
output's gradient (all but the last), [b / M, t, d] each. `balanced_split` (`pipeline_split:
auto`) gives each stage the layers that minimise the busiest rank's estimate. Measured against
each rank's peak at worlds 2 and 4 on CPU: bench/pipeline.py --memory (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from workers.config import JobSpec, mlp_tiles, with_overrides
from workers.parallel_dims import ring_head_chunks, stage_layers, stage_rank


def block_param_count(spec: JobSpec) -> int:
    """Parameters of one transformer block: q/o, k/v (head_dim may differ from d_model/n_heads),
    MLP, norms."""
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

# Measured on CPU (bench/memory.py --breakdown, BENCHMARKS.md "Memory per token"): the resident size
# of a rank before its step beyond its training state: interpreter, torch, gloo, the data source. A
# torchrun rank holds ~330 MB; a rank started from a larger parent (multiprocessing spawn, as the
# tests' ranks are, or a Ray worker) 30-70 MB more (tests/integration/test_memory_plan.py): the
# middle, so a fit errs on the side of fitting.
CPU_RUNTIME_BYTES = 360 * 10**6
# A tensor-parallel rank also holds its tensor group's gloo context and DTensor's dispatch caches,
# and the gathers and reduce-scatters around each block make fresh tensors: measured 30-70 MB more
# than the terms below on CPU (tests/integration/test_memory_plan.py, ring 1 and 2 x tensor_size 2).
CPU_RUNTIME_TP_BYTES = 40 * 10**6
# A model kind's own share (a pretrained model's process also holds transformers' modules) is its
# config class's `cpu_runtime_bytes` (`workers/config/`).
# The backward's own temporaries (gradients of the residual stream, of q/k/v and of the MLP) fit,
# measured, in what the backward frees as it consumes saved tensors: bench/memory.py, BENCHMARKS.md
# "Memory per token".


def _tile_tokens(spec: JobSpec, local_tokens: int) -> int:
    """Tokens of one MLP tile (`mlp_tiles`): the MLP's working set exists for this many tokens at a
    time."""
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
    # and the projections' outputs are a rank's piece of the sequence (1/T), the inputs the
    # attention and the MLP gather are whole
    # (the two norms' normalised inputs are among the pieces only where the norm keeps them)
    pieces = 4 if m.norm_keeps_normalized else 2
    rest = 2 * d + pieces * d // T + 2 * qd + 2 * kvd + h
    tiled = tr.tiled_mlp != "off"
    mode = tr.activation_checkpointing
    terms = {"kept": 0, "working": 0, "working_tile": mlp if tiled else 0, "offloaded": 0}
    block_mlp = 0 if tiled else mlp  # per-token MLP floats of a block's saved set
    if mode == "full":
        terms["kept"] = L * d // T  # one input per block: a rank's piece of the sequence
        # one block recomputed in backward: its MLP set whole, its attention side about half (the
        # backward frees saved tensors as it consumes them; fitted on the measured marginal bytes
        # per token)
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
    """The ring backward's buffers at its peak: one K/V-head chunk's K/V held and in flight
    (activation dtype) and its dK/dV travelling and arriving (fp32); nothing travels on a ring of
    one."""
    if ring == 1:
        return 0
    per_chunk = 2 * kvd // ring_head_chunks(kv_heads, ring)  # K and V floats per token
    return tokens * per_chunk * 2 * (act_bytes + 4)


ScheduleOp = tuple[str, int]  # ("F" forward | "B" backward | "W" deferred weight grad, local stage)


def schedule_ops(
    schedule: str, pipeline_size: int, microbatches: int, rank: int
) -> list[ScheduleOp]:
    """Pipeline rank `rank`'s compute in the order torch.distributed.pipelining runs it (the
    local stage of each op: 0, or 0/1 for the two virtual stages of the interleaved schedules).

    1f1b (`Schedule1F1B`): min(M, P - rank) forwards, then backward-forward pairs, then the
    remaining backwards. interleaved_1f1b and zero_bubble (`_get_1f1b_rank_ops`): rounds of
    m_r = M / max(1, M // P) microbatches per local stage; (V - 1) m_r + k (P - 1 - rank)
    forwards first (k = 2 interleaved, 1 zero bubble), then forward-backward pairs, then the
    remaining backwards; zero bubble's weight gradient (W) of a backward runs `rank` ops after it
    and its activations live until then."""
    P, M, r = pipeline_size, microbatches, rank
    if schedule == "1f1b":
        warm = min(M, P - r)
        ops: list[ScheduleOp] = [("F", 0)] * warm
        for i in range(M):
            ops.append(("B", 0))
            if warm + i < M:
                ops.append(("F", 0))
        return ops
    V, zb = 2, schedule == "zero_bubble"
    per_round = M // max(1, M // P)
    warm = min((V - 1) * per_round + (1 if zb else 2) * (P - 1 - r), M * V)
    total = M * V

    def fwd(op: int) -> int:
        return (op // per_round) % V

    def bwd(op: int) -> int:
        return V - 1 - ((op - warm) // per_round) % V

    ops, backwards = [], []  # backwards: the local stage of each B, in order, for its W
    for op in range(total + warm):
        if op < total:
            ops.append(("F", fwd(op)))
        if op < warm:
            continue
        ops.append(("B", bwd(op)))
        backwards.append(bwd(op))
        if zb and op - warm >= r:
            ops.append(("W", backwards[op - warm - r]))
    done = max(0, len(backwards) - r)  # the Ws run in the loop, `rank` Bs behind
    ops += [("W", stage) for stage in backwards[done:]] if zb else []
    return ops


@functools.lru_cache(maxsize=1024)
def _cached_ops(schedule: str, size: int, microbatches: int, rank: int) -> list[ScheduleOp]:
    """`schedule_ops`, once per shape: `balanced_split` walks the same schedules many times."""
    return schedule_ops(schedule, size, microbatches, rank)


def in_flight_peak(
    ops: list[ScheduleOp], cost: list[float], held: list[float] | None = None
) -> float:
    """The most bytes (or microbatch-stages, with cost 1 per stage) a rank's schedule holds at
    once: a forward of local stage l adds cost[l] (its saved activations) and its backward frees
    them; under zero bubble the backward for the inputs (B) also adds held[l] (the gradients of
    the weights' outputs, kept for the weight gradient) and the deferred weight gradient (W)
    frees both."""
    held = held or [0.0] * len(cost)
    deferred = any(kind == "W" for kind, _ in ops)
    live = peak = 0.0
    for kind, stage in ops:
        if kind == "F" or (kind == "B" and deferred):
            live += cost[stage] if kind == "F" else held[stage]
            peak = max(peak, live)
        else:
            live -= cost[stage] + (held[stage] if deferred else 0.0)
    return peak


def microbatches_in_flight(
    schedule: str, pipeline_size: int, microbatches: int, rank: int = 0
) -> int:
    """The most microbatch-stages whose activations pipeline rank `rank` keeps at once (rank 0
    runs the longest warmup): see `schedule_ops`."""
    ops = schedule_ops(schedule, pipeline_size, microbatches, rank)
    return int(in_flight_peak(ops, [1.0, 1.0]))


def _runtime_bytes(spec: JobSpec, acc: str) -> int:
    """The process's own bytes on CPU (interpreter, torch, gloo; more under tensor parallel)."""
    if acc != "cpu":
        return 0
    tp = CPU_RUNTIME_TP_BYTES if spec.parallel.tensor_size > 1 else 0
    return CPU_RUNTIME_BYTES + spec.model.cpu_runtime_bytes + tp


def _gathered_bytes(root: int, block: int, gathered_bytes: int) -> int:
    """FSDP's gathered copies: two blocks and the rank's root, and their fp32 gradients."""
    return gathered_bytes * (root + 2 * block) + 4 * (root + block)


def memory_estimate(spec: JobSpec, accelerator: str | None = None) -> dict[str, Any]:
    """A rank's peak bytes (what `mem_peak_bytes` measures) and its parts; see the module docstring.

    `accelerator`: "cpu" or "gpu" (default: the spec's `resources.accelerator`, auto counting as
    cpu)."""
    m, p = spec.model, spec.parallel
    acc = accelerator or ("gpu" if spec.resources.accelerator == "gpu" else "cpu")
    if p.pipeline_size > 1:
        return _pipeline_estimate(spec, acc)
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
        "runtime": _runtime_bytes(spec, acc),
        "params": 4 * p_rank // S,
        "grads": 4 * p_rank // S,
        "adamw": 8 * p_rank // S,
        "gathered": _gathered_bytes(p_root, p_block, gathered_bytes),
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
        "formula": "runtime (CPU: interpreter, torch, gloo) + 16*P_T/S (params, grads, AdamW: a "
        "tensor rank's share P_T, 1/T of every projection, sharded over the S = W/T ranks of the "
        "other dimensions) + gathered by FSDP (two blocks and the root, their fp32 grads) + "
        "activations kept for backward (per train.activation_checkpointing / tiled_mlp / "
        "offload_activations) + the backward's working set (one block recomputed and its "
        "gradients; the MLP's part per tile when tiled) + chunked loss + ring K/V buffers; b = "
        "batch/data_parallel, t = seq_len/(ring_size*ulysses_size); heads, K/V and MLP columns per "
        "rank divided by T = tensor_size; bytes per activation 4 on CPU, 2 on CUDA (bf16)",
    }


def _split_of(spec: JobSpec) -> list[int]:
    """Layers per stage: the spec's split, an even one, or (`auto`) the balanced one."""
    p = spec.parallel
    if p.pipeline_split == "auto":
        return balanced_split(spec)
    if p.pipeline_split is not None:
        return list(p.pipeline_split)
    return [len(r) for r in stage_layers(spec.model.n_layers, p.pipeline_stages)]


def pipeline_rank_bytes(
    spec: JobSpec,
    split: list[int] | None = None,
    accelerator: str | None = None,
    ranks: list[int] | None = None,
) -> list[dict[str, int]]:
    """Each pipeline rank's estimated bytes by part (index: the rank's place on the pipeline
    dimension; every rank of its stage slice holds the same), for `split` layers per stage
    (default: the spec's).

    A rank holds its stages' layers and, with the first stage, the embedding; with the last, the
    final norm, the head and the chunked loss. Its activations are those of the microbatch-stages
    its schedule keeps in flight (`schedule_ops`), each stage's weighted by its own layers.
    `ranks`: only these ranks' (in that order; `balanced_split` asks for one at a time)."""
    m, p, tr = spec.model, spec.parallel, spec.train
    acc = accelerator or ("gpu" if spec.resources.accelerator == "gpu" else "cpu")
    split = split if split is not None else _split_of(spec)
    T, P, M = p.tensor_size, p.pipeline_size, tr.microbatches
    fsdp = p.pipeline_schedule != "zero_bubble"  # zero bubble's stages keep whole parameters
    S = p.data_parallel * p.ring_size * p.ulysses_size if fsdp else 1
    p_block = local_block_param_count(spec)
    d, V = m.d_model, m.vocab_size
    act_bytes, gathered_bytes = (2, 2) if acc == "gpu" else (4, 4)
    b = tr.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * p.ulysses_size)
    mb_tokens = b // M * t
    terms = activation_terms(spec)
    # per token: what a stage keeps once per microbatch (embedding output or final norm input,
    # RoPE tables), and per layer (less what offload moves to the host)
    extra = (2 if m.norm_keeps_normalized else 1) * d + m.head_dim
    kept_per_layer = (terms["kept"] - extra - terms["offloaded"]) / m.n_layers
    # zero bubble, per token and layer, from a microbatch's input backward to its weight
    # gradient: the gradients of every weight's output (q, k, v, o; gate, up, down; both norms)
    weight_grads = 0
    if p.pipeline_schedule == "zero_bubble":
        weight_grads = (m.n_heads + 2 * m.kv_heads) * m.head_dim // T + 2 * m.ffn_hidden // T
        weight_grads += 4 * d
    tile = _tile_tokens(spec, mb_tokens)
    chunk = min(LOSS_CHUNK_TOKENS, mb_tokens)
    kvd = m.kv_heads * m.head_dim // T
    runtime = _runtime_bytes(spec, acc)
    stages = len(split)
    out = []
    for r in range(P) if ranks is None else ranks:
        local = [s for s in range(stages) if stage_rank(s, P) == r]
        first, last = 0 in local, stages - 1 in local
        root = (V * d if first else 0) + ((V * d + d) if last else 0)
        p_rank = sum(split[s] for s in local) * p_block + root
        ops = _cached_ops(p.pipeline_schedule, P, M, r)
        floats = in_flight_peak(
            ops,
            [kept_per_layer * split[s] + extra for s in local],
            [weight_grads * split[s] for s in local],
        )
        out.append(
            {
                "runtime": runtime,
                "params": 4 * p_rank // S,
                "grads": 4 * p_rank // S,
                "adamw": 8 * p_rank // S,
                "gathered": _gathered_bytes(root, p_block, gathered_bytes) if fsdp else 0,
                "activations": int(act_bytes * mb_tokens * floats),
                "backward_working_set": act_bytes
                * (mb_tokens * terms["working"] + tile * terms["working_tile"]),
                "loss": 4 * (2 * chunk * V + V * d + 2 * mb_tokens * d) if last else 0,
                "ring_buffers": _ring_buffer_bytes(
                    p.ring_size, m.kv_heads // T, kvd, mb_tokens, act_bytes
                ),
                # torch's receive buffers, one per microbatch: a stage's input (all but the
                # first) and its output's gradient (all but the last)
                "pipeline_buffers": act_bytes
                * mb_tokens
                * d
                * M
                * sum((s > 0) + (s < stages - 1) for s in local),
            }
        )
    return out


def balanced_split(spec: JobSpec, accelerator: str | None = None) -> list[int]:
    """`parallel.pipeline_split: auto`: layers per stage that minimise the busiest pipeline
    rank's estimate (`pipeline_rank_bytes`). Every stage starts with one layer; each further
    layer goes to the stage whose rank's estimate is then smallest (ties: the earlier stage).
    With one stage per rank a rank's bytes grow linearly in its layers and this greedy choice is
    the min-max optimum; with two stages per rank it is a good split, not a proven best."""
    stages, n_layers = spec.parallel.pipeline_stages, spec.model.n_layers
    if n_layers < stages:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages")
    P = spec.parallel.pipeline_size
    split = [1] * stages
    for _ in range(n_layers - stages):
        best: tuple[int, int] | None = None
        for s in range(stages):
            trial = split.copy()
            trial[s] += 1
            rank = [stage_rank(s, P)]
            total = sum(pipeline_rank_bytes(spec, trial, accelerator, rank)[0].values())
            if best is None or total < best[0]:
                best = (total, s)
        assert best is not None
        split[best[1]] += 1
    return split


def _pipeline_estimate(spec: JobSpec, acc: str) -> dict[str, Any]:
    """The busiest pipeline rank's bytes (`pipeline_rank_bytes`): the whole model's parts plus
    the receive buffers."""
    m, p, tr = spec.model, spec.parallel, spec.train
    split = _split_of(spec)
    ranks = pipeline_rank_bytes(spec, split, acc)
    totals = [sum(r.values()) for r in ranks]
    busiest = max(range(len(ranks)), key=lambda r: (totals[r], -r))
    parts = ranks[busiest]
    b = tr.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * p.ulysses_size)
    mb_tokens = b // tr.microbatches * t
    local = [s for s in range(len(split)) if stage_rank(s, p.pipeline_size) == busiest]
    ops = _cached_ops(p.pipeline_schedule, p.pipeline_size, tr.microbatches, busiest)
    flight = microbatches_in_flight(p.pipeline_schedule, p.pipeline_size, tr.microbatches, busiest)
    # on the host at once: the offloaded inputs of the microbatch-stages in flight, each of its
    # own stage's layers (as the activations)
    per_layer = activation_terms(spec)["offloaded"] / m.n_layers
    offloaded = in_flight_peak(ops, [per_layer * split[s] for s in local])
    return {
        "param_count": param_count(spec),
        "world_size": p.world_size,
        "local_tokens": t,
        "local_batch": b,
        "mlp_tile_tokens": _tile_tokens(spec, mb_tokens),
        "accelerator": acc,
        "offloaded_bytes": int((2 if acc == "gpu" else 4) * mb_tokens * offloaded),
        "bytes": parts,
        "total_bytes": totals[busiest],
        "pipeline": {
            "stages": p.pipeline_stages,
            "split": split,
            "busiest_rank": busiest,
            "rank_total_bytes": totals,
            "layers_on_rank": sum(split[s] for s in local),
            "microbatch_tokens": mb_tokens,
            "microbatches_in_flight": flight,
        },
        "formula": "busiest pipeline rank r: runtime + 16*P_r/S (its layers, plus the embedding "
        "with the first stage and the norm and head with the last, sharded over the stage's "
        "S = D*R*U ranks; 1 under zero_bubble) + FSDP's gathered blocks + the activations of the "
        "microbatch-stages its schedule keeps in flight (1f1b: min(M, P - r); interleaved_1f1b: "
        "(V-1) m_r + 2 (P-1-r) + 1; zero_bubble: (V-1) m_r + (P-1-r) + 1, each until its weight "
        "gradient, with its weights' output gradients from its input backward on), each of its "
        "own stage's layers, of b/M rows x t tokens + the backward's "
        "working set and ring buffers of one microbatch + the chunked loss (last stage) + the "
        "stages' receive buffers (M of the input, M of the output's gradient)",
    }


def resolve_pipeline_split(spec: JobSpec) -> JobSpec:
    """`spec` with every `parallel.pipeline_split: auto` (the job's, each stage's) replaced by
    `balanced_split`: what the control plane stores at submission, so the trainer and a
    resubmitted driver run the split the planner chose and never re-decide it. A stage's split is
    written into the stage (`with_overrides`), as the control plane stores what it resolves."""
    stages = {
        st.index: {"parallel": {"pipeline_split": balanced_split(st.spec)}}
        for st in (spec.stage_plan() if spec.stages else [])
        if st.spec.parallel.pipeline_split == "auto"
    }
    if stages:
        spec = with_overrides(spec, stages)
    if spec.parallel.pipeline_split != "auto":
        return spec
    data = spec.model_dump(mode="json")
    data["parallel"]["pipeline_split"] = balanced_split(spec)
    return JobSpec.model_validate(data)
