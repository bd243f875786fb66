"""The training loop of one rank: sequence parallel over a ring, data parallel over rings, state
sharded over all.

`Trainer` keeps the parts apart the way torchtitan does: `__init__` sets everything up (mesh, model,
optimizer, schedule, data, journal), `load(step)` restores an explicit checkpoint,
`forward_backward` runs one micro-step, `train_step` is one optimizer step with its metrics, and
`train` is the short loop around it (eval, checkpoint, stop). A `Trainer` runs one stage of its
job (`workers.config.stages`; a job without stages is one): it trains with the stage's effective
spec, numbers steps across the job, and starts a stage from the previous one's last checkpoint with
the stage's own schedule and data. It assumes the default process group
is up (world = data_parallel × ring_size × ulysses_size × tensor_size; world 1 may run without one)
and does not know where metrics go: it hands each `MetricPoint` to `emit`. `run_training` is the
one-call form the rank actor and the torchrun entry point use.

Model: built on `meta`, sharded with FSDP2 over the whole mesh (`parallelize`), then each rank
materialises its shards only (`materialize`). Loss: each rank backpropagates the *sum* of its
weighted token losses (chunked: no whole-shard fp32 logits); FSDP's reduce-scatter sums the
gradients over all ranks, a small all-reduce sums the token weights, and the gradient shards are
divided by the global weight — the global token mean, identical to single-process training on the
same batch.

Pipeline parallel (`parallel.pipeline_size` > 1, `workers.training.pipeline`): the model is this
rank's stages, the step runs the schedule over `train.microbatches` microbatches, each the sum of
its token losses on the last stage; the same division by the global weight follows, and the
gradient norm is summed over the pipeline ranks.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workers import metrics
from workers.config import JobSpec
from workers.data import Batch, TokensSource, build_source
from workers.models import (
    SequenceParallel,
    save_pretrained,
    tokenizer_for,
    training_attention_backend,
)
from workers.parallel_dims import ParallelDims
from workers.protocol import MetricPoint
from workers.training.checkpoint import latest_step, load_checkpoint, save_checkpoint
from workers.training.evals import passkey_accuracy
from workers.training.journal import MetricJournal, read_journal
from workers.training.lease import Lease
from workers.training.loss import linear_cross_entropy_sum
from workers.training.materialize import materialize, skeleton
from workers.training.memory import PeakMemory
from workers.training.mesh import build_mesh
from workers.training.optim import build_optimizer, build_scheduler, clip_grad_norm, state_bytes
from workers.training.parallelize import parallelize
from workers.training.pipeline import Pipeline, build_pipeline, full_state
from workers.training.ruler_eval import ruler_scores
from workers.training.validation import validation_loss
from workers.training.verify import VerificationFailed, verify

Emit = Callable[[MetricPoint], None]


@dataclass(frozen=True)
class TrainResult:
    final_step: int
    final_loss: float | None
    resumed_from: int | None
    attention_backend: str
    stopped: bool = False  # a stop request ended it (not the end of its stage)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step measured, reduced over all ranks where it is global."""

    loss: float
    lr: float
    grad_norm: float
    seconds: float
    stop_requested: bool
    # parameters + gradients + optimizer state held by this rank, at the optimizer step
    state_bytes: int
    # global tokens of the step (a curriculum's shorter contexts count as what they are)
    tokens: int


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def _autocast(device: torch.device) -> AbstractContextManager[object]:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


class Trainer:
    def __init__(
        self,
        spec: JobSpec,
        *,
        checkpoint_dir: str | Path | None,
        emit: Emit,
        stop: threading.Event | None = None,
        device: torch.device | None = None,
        lease: Lease | None = None,
        stage: int = 0,
    ) -> None:
        self.job = spec
        self.stages = spec.stage_plan()
        self.stage = self.stages[stage]
        spec = self.stage.spec  # the stage's effective spec: everything below trains with it
        self.spec, self.emit, self.stop, self.lease = spec, emit, stop, lease
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.device = device or default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.mesh = build_mesh(ParallelDims.of(spec.parallel), self.device.type)
        torch.manual_seed(spec.train.seed)
        self.model = skeleton(spec)
        self.pipeline: Pipeline | None = None
        if self.mesh.pipeline_size > 1:
            self.pipeline = build_pipeline(self.model, spec, self.mesh, self.device)
            self.model = self.pipeline.model  # type: ignore[assignment]  # this rank's stages
            self.parallelized = self.pipeline.parallelized
        else:
            self.parallelized = parallelize(
                self.model,
                self.mesh,
                self.device,
                spec.train.knobs,
            )
            materialize(self.model, spec, self.device)
        self.offload = self.parallelized.offload
        self.model.set_sequence_parallel(
            SequenceParallel(self.mesh.ring_group, spec.parallel.layout, self.mesh.ulysses_group)
        )
        self.model.train()
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, spec.train)
        self.scheduler = build_scheduler(self.optimizer, spec.train)
        self.tokenizer = tokenizer_for(spec)
        self.data = build_source(spec, self.tokenizer)
        self.memory = PeakMemory(self.device)
        self.attention_backend = training_attention_backend(self.device)
        self.step = 0
        self.resumed_from: int | None = None
        self.last_loss: float | None = None
        self.journal: MetricJournal | None = None
        # the pre-training check: before step 1, or after a resume onto another parallel shape
        self.needs_verification = spec.verify.enabled

    # -- checkpoints ---------------------------------------------------------------------------
    def load(self, step: int) -> None:
        """Continue from the checkpoint at `step` (0: from scratch, or from `spec.init_from`).
        Explicit on purpose: the caller decides which checkpoint (the driver's recovery, or
        `latest` for the torchrun entry), never this class."""
        if step == 0 and self.spec.init_from is not None:
            self._init_from()
        elif step > 0:
            if self.checkpoint_dir is None:
                raise ValueError(f"cannot resume from step {step} without a checkpoint directory")
            state = load_checkpoint(self.checkpoint_dir, step, self.model, self.optimizer)
            extra = state.get("extra", {})
            if extra.get("stage", 0) == self.stage.index:
                self.scheduler.load_state_dict(state["scheduler"])
                self.data.load_state_dict(state["data"])
            # else the previous stage's last checkpoint: this stage's own schedule and data start
            self.step, self.resumed_from, self.last_loss = step, step, extra.get("loss")
            saved = extra.get("spec", {}).get("parallel")
            moved = saved != self.spec.parallel.model_dump(mode="json")
            self.needs_verification = self.spec.verify.enabled and moved
        if self.checkpoint_dir is not None:
            if self.needs_verification and self._verified_at(step):
                self.needs_verification = False  # an earlier attempt checked this start
            self.journal = MetricJournal(self.checkpoint_dir, self.mesh.rank, step)

    def _init_from(self) -> None:
        """A new job's start from another run's checkpoint (`workers.config.init_from`), resharded
        onto this job's shape: the weights only (step 1 next, this job's own optimizer and
        schedule), or the full state (optimizer, schedule and data position too; the step count
        continues). The job's own checkpoints, once it has some, win over this
        (`load(step > 0)`)."""
        src = self.spec.init_from
        assert src is not None
        if src.checkpoint is None or src.step is None:
            raise ValueError(
                "init_from is resolved to a checkpoint directory and step at submission "
                "(or give both for the torchrun entry)"
            )
        full = src.state == "full"
        state = load_checkpoint(
            src.checkpoint, src.step, self.model, self.optimizer if full else None
        )
        if full:
            self.scheduler.load_state_dict(state["scheduler"])
            self.data.load_state_dict(state["data"])
            self.step, self.last_loss = src.step, state.get("extra", {}).get("loss")

    def _verified_at(self, step: int) -> bool:
        """Whether rank 0's journal holds a passed verification at `step` (an earlier attempt of
        this job started here: its points are stored, and checking again would store them twice);
        every rank gets rank 0's answer."""
        assert self.checkpoint_dir is not None
        done = self.mesh.rank == 0 and any(
            p.name == metrics.VERIFY_PASSED.name and p.step == step and p.value == 1.0
            for p in read_journal(self.checkpoint_dir, 0)
        )
        flag = torch.tensor([1.0 if done else 0.0], device=self.device)
        if self.mesh.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def latest_checkpoint(self) -> int:
        return (latest_step(self.checkpoint_dir) or 0) if self.checkpoint_dir is not None else 0

    def save(self) -> None:
        if self.checkpoint_dir is None:
            return
        self._fence()
        state = {
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "extra": {
                "loss": self.last_loss,
                "world": self.mesh.world,
                "stage": self.stage.index,
                "spec": self.spec.model_dump(mode="json"),
            },
        }
        save_checkpoint(
            self.checkpoint_dir,
            self.step,
            self.model,
            state,
            keep=self.spec.checkpoint.keep,
            optimizer=self.optimizer,
        )

    def export(self) -> None:
        """The finished model as a transformers directory, `<checkpoint dir>/model/`
        (collective: all ranks call)."""
        if self.checkpoint_dir is not None:
            longest = max(
                max(s.spec.data.seq_len, *s.spec.eval_context_lengths()) for s in self.stages
            )
            if self.pipeline is not None:  # the stages' weights, gathered on rank 0
                state = full_state(self.pipeline.model, self.mesh.dims.stage_size)
                save_pretrained(
                    self.pipeline.whole,
                    self.checkpoint_dir / "model",
                    max_position_embeddings=longest,
                    state=state,
                )
                return
            save_pretrained(
                self.model, self.checkpoint_dir / "model", max_position_embeddings=longest
            )

    # -- metrics -------------------------------------------------------------------------------
    def point(self, name: str, value: float, rank: int | None = None) -> None:
        p = MetricPoint(step=self.step, name=name, value=float(value), rank=rank, time=time.time())
        if self.journal is not None:
            self.journal.append(p)  # before emit: a point is on disk before anyone can have seen it
        self.emit(p)

    def evaluate(self) -> None:
        if not self.spec.eval.enabled:
            return
        results = {}
        suites = self.spec.eval_suites()
        # held-out documents of a prepared dataset (a corpus without a held-out share has none)
        if "val" in suites and isinstance(self.data, TokensSource):
            results.update(
                validation_loss(self.model, self.data, self.spec, self.mesh, self.device)
            )
        if "passkey" in suites:
            results.update(passkey_accuracy(self.model, self.spec, self.mesh, self.device))
        if "ruler" in suites:
            results.update(ruler_scores(self.model, self.spec, self.mesh, self.device))
        for name, value in results.items():
            if self.mesh.rank == 0:
                self.point(name, value)

    def verify(self) -> None:
        """Check the distributed forward/backward against a one-rank reference (`training.verify`),
        emit the result as `verify_*` points, and raise `VerificationFailed` (every rank, the same
        reason) when it is over tolerance."""
        result = verify(
            self.model,
            self.spec,
            self.mesh,
            self.device,
            # the dtype `_autocast` trains in
            autocast_dtype=torch.bfloat16 if self.device.type == "cuda" else None,
            finish_gradients=self.parallelized.finish_gradients,
            pipeline=self.pipeline,  # each stage checked on its own ranks
        )
        self.needs_verification = False
        if self.mesh.rank == 0:
            for name, value in result.metrics().items():
                self.point(name, value)
        if not result.passed:
            if self.mesh.distributed:
                dist.barrier()  # rank 0's points are in its buffer before any failure ends the job
            raise VerificationFailed(result.reason())

    # -- one step ------------------------------------------------------------------------------
    def local_batch(self) -> Batch:
        batch = self.data.global_batch(self.step, self.spec.train.batch_size)
        return self.mesh.shard(batch, self.spec.parallel.layout).to(self.device)

    def forward_backward(self, local: Batch) -> torch.Tensor:
        """Backpropagate this rank's *sum* of weighted token losses; returns it (normalised after
        the reduce).

        The head runs inside the chunked loss: after `features` the root's parameters (the head
        among them) are still gathered, and FSDP reduces their gradients at the end of backward.
        Under pipeline parallel the schedule runs every microbatch (0 on ranks without the last
        stage)."""
        if self.pipeline is not None:
            return self.pipeline.step(local)
        with _autocast(self.device):
            # packed documents: RoPE positions restart per document, attention stays inside each one
            positions = local.positions if local.doc_positions is None else local.doc_positions
            hidden = self.model.features(local.inputs, positions, cu_seqlens=local.cu_seqlens)
        loss_sum = linear_cross_entropy_sum(
            hidden, self.model.output_weight, local.labels, local.weights
        )
        # the loss keeps what it needs; held here, the last hidden states would outlive the backward
        del hidden
        loss_sum.backward()
        self.parallelized.finish_gradients()
        return loss_sum.detach().float()

    def backward_step(self, local: Batch) -> torch.Tensor:
        """Forward and backward of `local`, gradients reduced and divided by the global token
        weight: each parameter's `.grad` is its shard of the global token mean's gradient.
        Returns [loss sum, token weight, stop flag], each summed over the ranks; collective."""
        loss_sum = self.forward_backward(local)
        stop_flag = 1.0 if self.stop is not None and self.stop.is_set() else 0.0
        # a tensor group's ranks hold the same tokens: count them once (on tensor rank 0); the
        # pipeline's stages too (on the last, which holds the loss)
        last_stage = self.mesh.pp_rank == self.mesh.pipeline_size - 1
        counted = 1.0 if self.mesh.tp_rank == 0 and last_stage else 0.0
        stats = torch.stack(
            [
                loss_sum * counted,
                local.weights.sum().float() * counted,
                torch.tensor(stop_flag, device=self.device),
            ]
        )
        if self.mesh.distributed:
            # the gradients were summed by FSDP's reduce-scatter during backward
            dist.all_reduce(stats)
        total_weight = stats[1].clamp_min(1e-12)
        for p in self.params:
            # an unused parameter has no gradient: AdamW skips it, as on one process
            if p.grad is not None:
                p.grad.div_(total_weight)
        return stats

    def step_tokens(self, local: Batch) -> int:
        """Tokens in the global batch (for `tokens_per_s`): every rank of a pipeline stage holds
        an equal share of it, and a tensor group's ranks hold the same share."""
        return local.inputs.numel() * self.mesh.dims.stage_size // self.mesh.tensor_size

    def train_step(self) -> StepStats:
        """One optimizer step on the global batch of `self.step`; collective over all ranks."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        lr = float(self.scheduler.get_last_lr()[0])
        local = self.local_batch()
        stats = self.backward_step(local)
        total_weight = stats[1].clamp_min(1e-12)
        grad_norm = clip_grad_norm(
            self.params, self.spec.train.grad_clip, across=self.mesh.pp_group
        )
        self.optimizer.step()
        held = state_bytes(self.params, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        self.last_loss = float(stats[0] / total_weight)
        tokens = self.step_tokens(local)
        return StepStats(
            self.last_loss,
            lr,
            grad_norm,
            time.perf_counter() - t0,
            bool(stats[2] > 0),
            held,
            tokens,
        )

    def report(self, s: StepStats) -> None:
        if self.mesh.rank == 0:
            self.point(metrics.LOSS.name, s.loss)
            self.point(metrics.LR.name, s.lr)
            self.point(metrics.GRAD_NORM.name, s.grad_norm)
            self.point(metrics.TOKENS_PER_S.name, s.tokens / s.seconds)
            self.point(metrics.STEP_TIME_S.name, s.seconds)
            if self.job.stages:
                self.point(metrics.STAGE.name, self.stage.index)
            if self.job.elastic.enabled:
                self.point(metrics.WORLD_SIZE.name, self.mesh.world)
        self.point(metrics.MEM_PEAK_BYTES.name, self.memory.peak(), rank=self.mesh.rank)
        self.point(metrics.STATE_BYTES.name, s.state_bytes, rank=self.mesh.rank)

    # -- the loop ------------------------------------------------------------------------------
    def _fence(self) -> None:
        """Stop (raise `Fenced`) once a newer attempt owns the checkpoint directory (see
        `workers.training.lease`)."""
        if self.lease is not None:
            self.lease.check()

    def train(self, max_steps: int | None = None) -> TrainResult:
        """Train to the end of the stage, or to `max_steps` if that comes first (an absolute step;
        the schedule still follows the stage's length).

        A stop request on any rank ends every rank after the current step, with a checkpoint."""
        spec = self.spec
        last = self.stage.end_step
        end = last if max_steps is None else min(last, max_steps)
        if self.needs_verification:
            self.verify()
        saved_at = evaluated_at = self.step
        stopped = False
        with self.memory.steady():
            while self.step < end and not stopped:
                self.memory.reset()
                stats = self.train_step()
                stopped = stats.stop_requested
                self._fence()  # before this step's points reach the journal
                self.report(stats)
                # Evaluate before checkpointing: a checkpoint at step k then implies every point of
                # step k was emitted.
                if spec.eval.every_steps and self.step % spec.eval.every_steps == 0:
                    self.evaluate()
                    evaluated_at = self.step
                if spec.checkpoint.every_steps and self.step % spec.checkpoint.every_steps == 0:
                    self.save()
                    saved_at = self.step
        if not stopped and self.step != evaluated_at:
            self.evaluate()
        if self.step != saved_at:
            self.save()
        if self.step >= self.job.train.steps:
            self._fence()
            self.export()
        if self.journal is not None:
            self.journal.close()
        if self.mesh.world > 1:
            dist.barrier()
        return TrainResult(
            self.step, self.last_loss, self.resumed_from, self.attention_backend, stopped
        )


def run_training(
    spec: JobSpec,
    *,
    checkpoint_dir: str | Path | None,
    emit: Emit,
    stop: threading.Event | None = None,
    device: torch.device | None = None,
    max_steps: int | None = None,
    resume_step: int | None = None,
    lease: Lease | None = None,
) -> TrainResult:
    """Set up, resume and train; collective over all ranks.

    `resume_step`: the checkpoint to continue from (0: from scratch); None: the newest one in
    `checkpoint_dir`. Runs the stage that step belongs to, then each following stage on the same
    number of ranks; it returns at the end of the job, on a stop request, at `max_steps`, or before
    a stage that needs another number of ranks (the caller places it and calls again).
    `lease`: the attempt's hold on `checkpoint_dir` (the Ray driver's fencing); None: no other
    writer can exist.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if resume_step is None:
        resume_step = (latest_step(checkpoint_dir) or 0) if checkpoint_dir is not None else 0
    step = resume_step
    while True:
        stage = spec.stage_at(step)
        trainer = Trainer(
            spec,
            stage=stage.index,
            checkpoint_dir=checkpoint_dir,
            emit=emit,
            stop=stop,
            device=device,
            lease=lease,
        )
        trainer.load(step)
        result = trainer.train(max_steps)
        del trainer  # the next stage builds its own model, on its own mesh
        step = result.final_step
        nxt = spec.stage_at(step)
        done = result.stopped or step >= spec.train.steps or nxt.index == stage.index
        if done or (max_steps is not None and step >= max_steps):
            return result
        if nxt.spec.parallel.world_size != world:
            return result
