"""Every job proves its math before it spends the cluster: the distributed path against a reference.

Before step 1 (and after a resume onto another parallel shape) each rank runs forward and backward
of the job's own model on a short random sequence (`spec.verify.tokens`, seeded, identical on every
rank) twice:

- distributed: exactly as training runs it (FSDP as configured, ring or Ulysses x ring attention
  with the chosen block kernels and layout, packed documents when the data is packed, the compute
  dtype);
- reference: the *same* FSDP model, every rank on the whole gathered sequence, with attention
  swapped for plain dense causal attention on one process (`dense_attention`: fp32 math, a document
  mask when packed, none of the ring's code). FSDP still gathers the parameters one block at a
  time, so the reference fits wherever training fits; it costs one forward/backward of the short
  sequence.

It compares the logits and every parameter's gradient (relative Frobenius error, sums of squares
all-reduced over the ranks) and reports the largest. Low-precision jobs also report the attention op
alone (their q/k/v shapes, ring or Ulysses x ring, in bf16) against an fp32 dense reference.

Under pipeline parallel a rank holds only its stages, so each stage is checked on its own by its
own ranks (`StagePlan` says what is compared and why); the job's result is the worst over the
stages, reported as above.

Training is not disturbed: no optimizer step, gradients back to None, RNG state restored and the
model's sequence-parallel setting put back, so the loss curve is bit-identical with the check on or
off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from workers import metrics as catalog
from workers.config import JobSpec
from workers.data.batch import Batch, from_windows
from workers.models import RingModel, SequenceParallel
from workers.parallel_dims import ParallelDims, stage_layers
from workers.training.loss import linear_cross_entropy_sum
from workers.training.mesh import Mesh
from workers.training.pipeline import Pipeline, StageModule, stage_inputs

# The largest relative error (logits or any parameter's gradient) a job may show against the
# reference, per compute dtype. fp32: measured <= 1.6e-6 on every supported shape (README,
# "Verification"), so 1e-4 leaves 60x headroom and still catches any real math error (a dropped
# block, a wrong mask or position: 1e-2 and up). bf16: rounding of the block outputs and of every
# activation, measured <= 6.2e-3 (CPU autocast, 2 layers; it grows with depth), hence 5e-2. fp16
# keeps 3 more mantissa bits than bf16.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}
SEED_OFFSET = 0x5EED  # the check's inputs come from the job seed, apart from its data stream


class VerificationFailed(RuntimeError):
    """The distributed math differs from the reference by more than the dtype's tolerance."""


@dataclass(frozen=True)
class Verification:
    """What the check measured (the same on every rank: the errors are all-reduced)."""

    max_rel_err: float
    worst: str  # what diverged most: "logits" or "gradient of <parameter>"
    tolerance: float
    tokens: int
    seconds: float
    dtype: str  # the compute dtype checked, e.g. "float32", "bfloat16"
    fp32_rel_err: float | None = None  # low precision only: the attention op against fp32

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_rel_err) and self.max_rel_err <= self.tolerance

    def reason(self) -> str:
        verdict = "passed" if self.passed else "failed before step 1"
        limit = f"tolerance {self.tolerance:.3g} for {self.dtype}, {self.tokens} tokens"
        return (
            f"verification {verdict}: largest difference from the one-rank reference in "
            f"{self.worst}: {self.max_rel_err:.3g} relative ({limit})"
        )

    def metrics(self) -> dict[str, float]:
        """The metric points a job emits (the control plane derives `verification` from them)."""
        out = {
            catalog.VERIFY_MAX_REL_ERR.name: self.max_rel_err,
            catalog.VERIFY_TOLERANCE.name: self.tolerance,
            catalog.VERIFY_PASSED.name: 1.0 if self.passed else 0.0,
            catalog.VERIFY_TOKENS.name: float(self.tokens),
            catalog.VERIFY_SECONDS.name: self.seconds,
        }
        if self.fp32_rel_err is not None:
            out[catalog.VERIFY_FP32_REL_ERR.name] = self.fp32_rel_err
        return out


def verification_tokens(spec: JobSpec) -> int:
    """`spec.verify.tokens`, at most the job's own sequence length (what its RoPE settings were
    validated for), rounded down to what the layout needs (at least one multiple of it)."""
    p = spec.parallel
    need = ParallelDims.of(p).seq_divisor(p.layout)
    return max(need, min(spec.verify.tokens, spec.data.seq_len) // need * need)


def verification_batch(spec: JobSpec, tokens: int) -> Batch:
    """One random sequence of `tokens` tokens from the job's seed (random token weights too);
    random documents when the data is packed."""
    gen = torch.Generator().manual_seed(spec.train.seed + SEED_OFFSET)
    ids = torch.randint(0, spec.model.vocab_size, (1, tokens + 1), generator=gen)
    batch = from_windows(ids, torch.rand((1, tokens), generator=gen) + 0.5)
    if spec.data.kind == "text" and spec.data.pack == "documents":
        cuts = torch.randperm(tokens - 1, generator=gen)[: max(1, tokens // 48)] + 1
        bounds = torch.tensor([0, *sorted(int(c) for c in cuts), tokens])
        starts = bounds[:-1].repeat_interleave(bounds[1:] - bounds[:-1])
        batch.cu_seqlens = bounds.to(torch.int32)
        batch.doc_positions = (torch.arange(tokens) - starts)[None]
    return batch


def _document_ids(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] document index of every token, for both forms of `cu_seqlens` that
    `ring_attention` accepts (one set of boundaries for all rows, or one per row, flattened)."""
    cu = cu_seqlens.to(torch.int64)
    per_row = int(cu[-1]) != seq
    tokens = torch.arange(batch * seq if per_row else seq, device=cu.device)
    ids = torch.bucketize(tokens, cu[1:], right=True)
    return ids.view(batch, seq) if per_row else ids.expand(batch, seq)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention of a whole sequence on one process in fp32 (fp64 for fp64).

    [batch, seq, heads, head_dim] in and out (k/v may have fewer heads: GQA); `cu_seqlens` keeps
    each token inside its packed document. Plain differentiable torch ops: the reference."""
    b, s, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    with torch.autocast(q.device.type, enabled=False):
        group = h // k.shape[2]
        qf = q.to(acc)
        kf, vf = (x.to(acc).repeat_interleave(group, dim=2) for x in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
        visible = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
        if cu_seqlens is not None:
            doc = _document_ids(cu_seqlens.to(q.device), b, s)
            visible = visible & (doc[:, None, :, None] == doc[:, None, None, :])
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype)


@dataclass(frozen=True)
class OneRankAttention(SequenceParallel):
    """A model's attention as `dense_attention` over its whole local sequence (the reference)."""

    @property
    def world(self) -> int:
        return 1

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return dense_attention(q, k, v, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)


def _sequence_parallel(model: RingModel) -> SequenceParallel | None:
    return model.sequence_parallel


@contextmanager
def _preserved_rng(device: torch.device) -> Iterator[None]:
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _param_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _pass(
    model: RingModel,
    batch: Batch,
    rows: torch.Tensor | None,
    autocast: AbstractContextManager[object],
    grad_scale: float,
    finish_gradients: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of `batch`: (the logits of sequence positions `rows`, or of all, and
    every parameter's local gradient times `grad_scale` by name); the gradients are None again
    after."""
    positions = batch.positions if batch.doc_positions is None else batch.doc_positions
    with autocast:
        hidden = model.features(batch.inputs, positions, cu_seqlens=batch.cu_seqlens)
    weight = model.output_weight
    with torch.no_grad():  # the head is gathered now (FSDP reshards the root after backward)
        picked = hidden.detach() if rows is None else hidden.detach()[:, rows]
        logits = (picked @ weight.detach().to(picked.dtype).t()).float()
    linear_cross_entropy_sum(hidden, weight, batch.labels, batch.weights).backward()
    if finish_gradients is not None:
        finish_gradients()
    return logits, _take_gradients(model, grad_scale, hidden.device)


def _take_gradients(
    module: torch.nn.Module, grad_scale: float, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every parameter's local gradient times `grad_scale`, by parameter name (empty for a
    parameter without one: unused); the gradients are None again after."""
    none = torch.zeros(0, device=device)
    grads = {
        _param_name(name): _local(p.grad).float() * grad_scale if p.grad is not None else none
        for name, p in module.named_parameters()
    }
    module.zero_grad(set_to_none=True)
    return grads


def _squares(a: torch.Tensor, ref: torch.Tensor) -> list[torch.Tensor]:
    if a.numel() == 0 and ref.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64, device=a.device)
        return [zero, zero]
    a64, r64 = a.to(torch.float64), ref.to(torch.float64)
    return [(a64 - r64).pow(2).sum(), r64.pow(2).sum()]


def _relative_errors(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    distributed: bool,
) -> list[float]:
    """||a - ref|| / ||ref|| per pair; the sums of squares are summed over all ranks (parameter
    shards, or sequence pieces)."""
    sums = torch.stack([torch.stack(_squares(a, ref)) for a, ref in pairs])
    if distributed:
        dist.all_reduce(sums)
    return _ratios(sums)


def _named_relative_errors(
    named: dict[str, tuple[torch.Tensor, torch.Tensor]],
    distributed: bool,
    device: torch.device,
) -> dict[str, float]:
    """`_relative_errors` when ranks compare different things (pipeline stages hold different
    parameters): the names are gathered in rank order, each rank adds the sums of squares of its
    own and zeros for the rest, so every rank gets every stage's errors."""
    names = list(named)
    if distributed:
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = list(dict.fromkeys(n for part in gathered for n in part or []))
    sums = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        if name in named:
            sums[i] = torch.stack(_squares(*named[name]))
    if distributed:
        dist.all_reduce(sums)
    return dict(zip(names, _ratios(sums), strict=True))


def _ratios(sums: torch.Tensor) -> list[float]:
    """[n, 2] sums of (squared differences, squared reference) -> n relative errors (inf where
    only the difference is non-zero)."""
    diff, ref = sums[:, 0].sqrt(), sums[:, 1].sqrt()
    only_diff = torch.where(diff > 0, math.inf, 0.0)
    errs = torch.where(ref > 0, diff / ref.clamp_min(1e-300), only_diff)
    return [float(e) for e in errs.cpu()]


def _attention_vs_fp32(
    spec: JobSpec,
    sp: SequenceParallel | None,
    batch: Batch,
    local: Batch,
    dtype: torch.dtype,
    distributed: bool,
) -> float:
    """The attention op alone, run as the job runs it in `dtype`, against `dense_attention` in
    fp32 on the same (rounded) inputs: the output and dq/dk/dv."""
    m = spec.model
    device = local.inputs.device
    gen = torch.Generator().manual_seed(spec.train.seed + SEED_OFFSET + 1)
    s = batch.inputs.shape[1]
    shapes = [
        (1, s, m.n_heads, m.head_dim),
        *[(1, s, m.kv_heads, m.head_dim)] * 2,
        (1, s, m.n_heads, m.head_dim),
    ]
    q, k, v, dout = (torch.randn(x, generator=gen).to(dtype).to(device) for x in shapes)
    rows = local.positions.to(device)
    mine = [x[:, rows].detach().requires_grad_() for x in (q, k, v)]
    attn = sp if sp is not None else SequenceParallel(None)
    out = attn.attend(*mine, cu_seqlens=local.cu_seqlens)
    out.backward(dout[:, rows])
    full = [x.detach().float().requires_grad_() for x in (q, k, v)]
    documents = batch.cu_seqlens.to(device) if batch.cu_seqlens is not None else None
    ref = dense_attention(*full, cu_seqlens=documents)
    ref.backward(dout.float())
    pairs = [(out.detach(), ref.detach()[:, rows])]
    for a, r in zip(mine, full, strict=True):
        assert a.grad is not None and r.grad is not None
        pairs.append((a.grad, r.grad[:, rows]))
    return max(_relative_errors(pairs, distributed))


@dataclass(frozen=True)
class StagePlan:
    """The verification plan under pipeline parallel: what one stage's ranks compare, and why.

    Without a pipeline the check runs the whole model on every rank; a pipeline rank holds only its
    stages, so each stage is checked on its own, by its own ranks, every stage at once (no stage
    waits for another's output and nothing crosses a stage boundary):

    - input: the first stage takes the check's tokens; a later stage a seeded random residual
      stream [1, tokens, d_model] (drawn per stage, the same on every rank) in place of what the
      previous stage would send;
    - distributed: the stage's own forward (`StageModule`: its blocks with its ring, Ulysses and
      tensor groups, FSDP over its slice, the embedding on the first stage, the final norm, head
      and chunked loss on the last) and backward, from the loss sum on the last stage and from a
      seeded random output gradient on the others;
    - reference: the same stage on the whole sequence with dense one-rank attention;
    - compared: the stage's output (the logits on the last stage, the hidden states it would send
      on the others: an output that only the next stage consumed would go unchecked otherwise),
      the gradient of its input (what its backward would send back; the first stage's tokens
      have none) and the gradient of every parameter it holds.

    Every rank adds up every stage's sums of squares (`_named_relative_errors`), so all ranks see
    the same errors and the job's one result is the worst over the stages, named with its stage.
    Not covered: the stage-to-stage send/recv and the schedule's microbatches, which the
    equivalence tests (`tests/unit/workers/training/test_pipeline.py`) check by training the same
    model as one process.
    """

    index: int
    layers: range
    last: bool

    @classmethod
    def of(cls, pipeline: Pipeline, spec: JobSpec) -> list[StagePlan]:
        """The plans of this rank's stages, in `pipeline.model.stage_modules` order (the layers
        as `build_pipeline` cut them)."""
        n, stages = pipeline.whole.cfg.n_layers, pipeline.num_stages
        ranges = stage_layers(n, stages, spec.parallel.pipeline_split)
        return [cls(s, ranges[s], s == stages - 1) for s in pipeline.stage_indices]

    @property
    def first(self) -> bool:
        return self.index == 0

    def describe(self) -> str:
        return f"stage {self.index} (layers {self.layers.start}-{self.layers.stop - 1})"

    @property
    def output(self) -> str:
        return f"logits of {self.describe()}" if self.last else f"output of {self.describe()}"

    @property
    def input_gradient(self) -> str:
        return f"gradient of the input of {self.describe()}"

    def gradient(self, parameter: str) -> str:
        return f"gradient of {parameter} in {self.describe()}"

    def inputs(self, spec: JobSpec, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """A later stage's random input and output gradient, [1, tokens, d_model] each (the
        first stage takes tokens; the last starts its backward from the loss)."""
        gen = torch.Generator().manual_seed(spec.train.seed + SEED_OFFSET + 2 + self.index)
        shape = (1, tokens, spec.model.d_model)
        return tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))


def _check_model(
    model: RingModel,
    spec: JobSpec,
    mesh: Mesh,
    local: Batch,
    whole: Batch,
    autocast: Callable[[], AbstractContextManager[object]],
    finish_gradients: Callable[[], None] | None,
) -> dict[str, float]:
    """The whole model against its one-rank reference: the logits and every parameter's gradient
    (the same names on every rank)."""
    rows = local.positions.to(local.inputs.device)
    sp = _sequence_parallel(model)
    # every data-parallel replica runs the same sequence: data_parallel x one gradient
    got_logits, got_grads = _pass(
        model, local, None, autocast(), 1 / mesh.data_parallel, finish_gradients
    )
    model.set_sequence_parallel(OneRankAttention(None, spec.parallel.layout))
    # every rank runs the whole sequence: FSDP's reduce-scatter sums one gradient per rank of its
    # mesh (all but the tensor dimension, whose ranks split the gradient instead)
    summed = mesh.world // mesh.tensor_size
    ref_logits, ref_grads = _pass(model, whole, rows, autocast(), 1 / summed, finish_gradients)
    model.set_sequence_parallel(sp)
    names = ["logits", *(f"gradient of {n}" for n in got_grads)]
    pairs = [(got_logits, ref_logits), *((got_grads[n], ref_grads[n]) for n in got_grads)]
    return dict(zip(names, _relative_errors(pairs, mesh.distributed), strict=True))


def _stage_pass(
    module: StageModule,
    plan: StagePlan,
    x: torch.Tensor,
    batch: Batch,
    dout: torch.Tensor,
    rows: torch.Tensor | None,
    grad_scale: float,
    finish: Callable[[], None],
    autocast: AbstractContextManager[object],
) -> dict[str, torch.Tensor]:
    """Forward and backward of one stage on `x` (tokens, or hidden states of `batch`'s
    positions): its output at sequence positions `rows` (or all), its input's gradient there,
    and every parameter's local gradient times `grad_scale`, by `plan`'s names; gradients are
    None again after."""
    device = batch.inputs.device
    logits: list[torch.Tensor] = []

    def keep_logits(norm: torch.nn.Module, args: object, hidden: torch.Tensor) -> None:
        # inside the stage's forward: FSDP holds its root (norm, head) gathered here
        assert module.head is not None
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            logits.append(hidden.detach().float() @ module.head.weight.detach().float().t())

    x = x if plan.first else x.detach().requires_grad_()
    hook = module.norm.register_forward_hook(keep_logits) if module.norm is not None else None
    try:
        with autocast:  # what the stage's own forward adds on CUDA; on CPU the check's bf16
            out = module(x, **stage_inputs(batch, device))
    finally:
        if hook is not None:
            hook.remove()
    if plan.last:
        got = logits[0]
        out.backward()
    else:
        got = out.detach().float()
        out.backward(dout.to(out.dtype))
    finish()
    pick = (lambda t: t) if rows is None else (lambda t: t[:, rows])
    result = {plan.output: pick(got)}
    if not plan.first:
        assert x.grad is not None
        result[plan.input_gradient] = pick(x.grad.float())
    for name, grad in _take_gradients(module, grad_scale, device).items():
        result[plan.gradient(name)] = grad
    return result


def _check_stages(
    pipeline: Pipeline,
    spec: JobSpec,
    mesh: Mesh,
    local: Batch,
    whole: Batch,
    dtype: torch.dtype,
    autocast: Callable[[], AbstractContextManager[object]],
    finish_gradients: Callable[[], None] | None,
) -> dict[str, float]:
    """Every stage of this rank against its one-rank reference (`StagePlan`); the relative
    errors of every stage of the job, the same on every rank."""
    model = pipeline.model
    rows = local.positions.to(local.inputs.device)

    def finish() -> None:  # what training runs after the schedule's backward
        pipeline.sum_stage_gradients()
        if finish_gradients is not None:
            finish_gradients()

    # FSDP (or `sum_stage_gradients`) sums over the stage's dp x ring x ulysses ranks: every
    # replica runs the same sequence, and in the reference every rank runs all of it
    summed = mesh.dims.stage_size // mesh.tensor_size
    sp = model.sequence_parallel
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for plan, module in zip(StagePlan.of(pipeline, spec), model.stage_modules, strict=True):
        drawn = plan.inputs(spec, whole.inputs.shape[1], dtype)
        hidden, dout = (t.to(local.inputs.device) for t in drawn)
        x_local = local.inputs if plan.first else hidden[:, rows]
        x_whole = whole.inputs if plan.first else hidden
        got = _stage_pass(
            module,
            plan,
            x_local,
            local,
            dout[:, rows],
            None,
            1 / mesh.data_parallel,
            finish,
            autocast(),
        )
        model.set_sequence_parallel(OneRankAttention(None, spec.parallel.layout))
        ref = _stage_pass(module, plan, x_whole, whole, dout, rows, 1 / summed, finish, autocast())
        model.set_sequence_parallel(sp)
        pairs.update({name: (got[name], ref[name]) for name in got})
    return _named_relative_errors(pairs, mesh.distributed, local.inputs.device)


def verify(
    model: RingModel,
    spec: JobSpec,
    mesh: Mesh,
    device: torch.device,
    *,
    autocast_dtype: torch.dtype | None = None,
    finish_gradients: Callable[[], None] | None = None,
    pipeline: Pipeline | None = None,
) -> Verification:
    """Run the check (collective over all ranks); the caller decides what a failure does.

    `autocast_dtype`: the dtype training computes in under autocast (bf16 on CUDA); None: fp32.
    `finish_gradients`: what training runs after backward (`Parallelized.finish_gradients`).
    `pipeline`: this rank's stages under pipeline parallel (`model` is `pipeline.model`): each
    stage is checked on its own (`StagePlan`)."""
    t0 = time.perf_counter()
    tokens = verification_tokens(spec)
    batch = verification_batch(spec, tokens)
    local = mesh.shard(batch, spec.parallel.layout, replicated=True).to(device)
    whole = batch.to(device)
    dtype = autocast_dtype or torch.float32

    def autocast() -> AbstractContextManager[object]:
        if autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    sp = _sequence_parallel(model)
    was_training = model.training
    model.train()
    model.zero_grad(set_to_none=True)
    try:
        with _preserved_rng(device):
            if pipeline is not None:
                errors = _check_stages(
                    pipeline, spec, mesh, local, whole, dtype, autocast, finish_gradients
                )
            else:
                errors = _check_model(model, spec, mesh, local, whole, autocast, finish_gradients)
            fp32_err = None
            if dtype != torch.float32:
                fp32_err = _attention_vs_fp32(spec, sp, batch, local, dtype, mesh.distributed)
    finally:
        model.set_sequence_parallel(sp)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    worst = max(errors, key=lambda n: math.inf if math.isnan(errors[n]) else errors[n])
    seconds = time.perf_counter() - t0
    if mesh.distributed:  # one duration for the job: the slowest rank's
        took = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        seconds = float(took)
    return Verification(
        max_rel_err=errors[worst],
        worst=worst,
        tolerance=TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16]),
        tokens=tokens,
        seconds=seconds,
        dtype=str(dtype).removeprefix("torch."),
        fp32_rel_err=fp32_err,
    )
