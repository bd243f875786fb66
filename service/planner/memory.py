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

Pipeline parallel (`parallel.pipeline_size` P > 1): the busiest pipeline rank is estimated (the
one holding the most layers, its stages' share of the root counted whole). Its state is its
layers' parameters sharded over its stage's S = D x R x U ranks (not sharded under zero_bubble,
whose stages run without FSDP); every token count above is one microbatch's (b / M rows), and the
activations are kept for F microbatch-stages at once, F the most a rank holds in flight under the
schedule (torch.distributed.pipelining's warmup on pipeline rank 0):

    1f1b               F = min(M, P)                                  (stages of L_s layers)
    interleaved_1f1b,  F = min(M·V, (V - 1)·m_r + 2·(P - 1) + 1)      (V = 2 stages per rank,
    zero_bubble                                                        m_r = M / max(1, M // P))

plus each stage's receive buffers (the input and its gradient, [b / M, t, d]). Unmeasured: the
formula follows the schedules' order of work, not a measured peak.
"""

from __future__ import annotations

import math
from typing import Any

from workers.config import JobSpec, mlp_tiles
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


def microbatches_in_flight(schedule: str, pipeline_size: int, microbatches: int) -> int:
    """The most microbatch-stages whose activations one pipeline rank keeps at once (rank 0, which
    runs the longest warmup): see the module docstring."""
    P, M = pipeline_size, microbatches
    if schedule == "1f1b":
        return min(M, P)
    V = 2
    per_round = M // max(1, M // P)
    return min(M * V, (V - 1) * per_round + 2 * (P - 1) + 1)


def _pipeline_rank_layers(spec: JobSpec) -> tuple[int, int]:
    """(layers on the busiest pipeline rank, layers of its largest stage)."""
    p = spec.parallel
    ranges = stage_layers(spec.model.n_layers, p.pipeline_stages, p.pipeline_split)
    per_rank = [0] * p.pipeline_size
    for s, layers in enumerate(ranges):
        per_rank[stage_rank(s, p.pipeline_size)] += len(layers)
    return max(per_rank), max(len(r) for r in ranges)


def memory_estimate(spec: JobSpec, accelerator: str | None = None) -> dict[str, Any]:
    """A rank's peak bytes (what `mem_peak_bytes` measures) and its parts; see the module docstring.

    `accelerator`: "cpu" or "gpu" (default: the spec's `resources.accelerator`, auto counting as
    cpu)."""
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
    if p.pipeline_size > 1:
        return _pipeline_estimate(spec, acc, parts)
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


def _pipeline_estimate(spec: JobSpec, acc: str, whole: dict[str, int]) -> dict[str, Any]:
    """The busiest pipeline rank's bytes: `whole` (the same shape without a pipeline) with state,
    activations and token-sized terms redone for its layers and microbatches."""
    m, p, tr = spec.model, spec.parallel, spec.train
    T = p.tensor_size
    S = (
        1
        if p.pipeline_schedule == "zero_bubble"
        else p.data_parallel * p.ring_size * p.ulysses_size
    )
    P = param_count(spec)
    rank_layers, stage_max = _pipeline_rank_layers(spec)
    p_root = P - m.n_layers * block_param_count(spec)
    p_rank = rank_layers * local_block_param_count(spec) + p_root
    act_bytes = 2 if acc == "gpu" else 4
    b = tr.batch_size // p.data_parallel
    t = spec.data.seq_len // (p.ring_size * p.ulysses_size)
    mb_tokens = b // tr.microbatches * t
    flight = microbatches_in_flight(p.pipeline_schedule, p.pipeline_size, tr.microbatches)
    terms = activation_terms(spec)
    extra = (2 if m.norm_keeps_normalized else 1) * m.d_model + m.head_dim
    per_layer = (terms["kept"] - extra) / m.n_layers
    offloaded_per_layer = terms["offloaded"] / m.n_layers
    kept = flight * (per_layer * stage_max + extra)
    offloaded = flight * offloaded_per_layer * stage_max
    tile = _tile_tokens(spec, mb_tokens)
    chunk = min(LOSS_CHUNK_TOKENS, mb_tokens)
    d, kvd, V = m.d_model, m.kv_heads * m.head_dim // T, m.vocab_size
    parts = dict(whole)
    parts.update(
        {
            "params": 4 * p_rank // S,
            "grads": 4 * p_rank // S,
            "adamw": 8 * p_rank // S,
            "activations": int(act_bytes * mb_tokens * (kept - offloaded)),
            "backward_working_set": act_bytes
            * (mb_tokens * terms["working"] + tile * terms["working_tile"]),
            "loss": 4 * (2 * chunk * V + V * d + 2 * mb_tokens * d),
            "ring_buffers": _ring_buffer_bytes(
                p.ring_size, m.kv_heads // T, kvd, mb_tokens, act_bytes
            ),
            "pipeline_buffers": act_bytes * mb_tokens * d * 2 * p.virtual_stages,
        }
    )
    return {
        "param_count": P,
        "world_size": p.world_size,
        "local_tokens": t,
        "local_batch": b,
        "mlp_tile_tokens": tile,
        "accelerator": acc,
        "offloaded_bytes": int(act_bytes * mb_tokens * offloaded),
        "bytes": parts,
        "total_bytes": sum(parts.values()),
        "pipeline": {
            "stages": p.pipeline_stages,
            "layers_on_rank": rank_layers,
            "microbatch_tokens": mb_tokens,
            "microbatches_in_flight": flight,
        },
        "formula": "pipeline rank with the most layers: runtime + 16*P_r/S (its layers and the "
        "root, sharded over the stage's S = D*R*U ranks; 1 under zero_bubble) + gathered blocks "
        "+ activations of F microbatches in flight (1f1b: min(M, P); interleaved_1f1b and "
        "zero_bubble: min(2M, m_r + 2(P-1) + 1)) of b/M rows x t tokens each, for the rank's "
        "largest stage + the backward's working set, chunked loss and ring buffers of one "
        "microbatch + the stages' receive buffers",
    }
