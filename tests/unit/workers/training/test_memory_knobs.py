"""Memory knobs change memory, not math: same loss and gradients with and without each one.

Each case builds the real `Trainer` (FSDP over the ring, the knobs applied from outside by
`parallelize`), runs one `forward_backward` on the same global batch and gathers the full gradients;
every knob combination is compared with the plain run of the same world, in fp32, for the native
model and a tiny transformers Qwen2. Offload is CUDA-only in jobs; its mechanism runs here on CPU
(`offload_block_inputs` with a CPU device)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import CORPUS, write_checkpoint
from tests.support.trainutil import one_thread, tiny_spec  # noqa: F401  (fixture)
from workers.config import JobSpec, mlp_tiles

KNOBS: list[dict[str, Any]] = [
    {},
    {"activation_checkpointing": "full"},
    {"activation_checkpointing": "selective"},
    {"tiled_mlp": 3},
    {"tiled_mlp": "auto", "activation_checkpointing": "full"},
    {"tiled_mlp": 4, "activation_checkpointing": "selective"},
]
RTOL = 1e-5  # fp32; measured differences are <= 2e-7 of a gradient's largest element
ATOL_OF_SCALE = 2e-6


def _parallelize_offloading_on_cpu(model, mesh, device, knobs):
    """`parallelize` with full checkpointing and the offload mechanism forced on (CPU copies, no streams)."""
    from workers.training import parallelize as par
    from workers.training.offload import offload_block_inputs

    if knobs.tiled:
        par.apply_tiled_mlp(model, knobs.tiled_mlp, par._hidden_size(model))
    par.apply_activation_checkpointing(model)
    state = offload_block_inputs(model.layers, device)
    if mesh.shard_mesh is not None:
        par.apply_fsdp(model, mesh, device)
    return par.Parallelized(offload=state)


def _grads(rank: int, world: int, specs: list[str], offload_on_cpu: bool) -> list[dict[str, Any]]:
    """Loss and full gradients of one forward_backward per spec (collective)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import workers.training.trainer as trainer_module

    out = []
    for spec_json in specs:
        spec = JobSpec.model_validate_json(spec_json)
        real = trainer_module.parallelize
        if offload_on_cpu:
            trainer_module.parallelize = _parallelize_offloading_on_cpu  # type: ignore[assignment]
        try:
            trainer = trainer_module.Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
        finally:
            trainer_module.parallelize = real  # type: ignore[assignment]
        loss = trainer.forward_backward(trainer.local_batch())
        total = loss.clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        grads = {}
        for name, p in trainer.model.named_parameters():
            g = p.grad
            assert g is not None, name
            name = name.replace("_checkpoint_wrapped_module.", "")
            full = g.full_tensor() if isinstance(g, DTensor) else g
            grads[name] = full.detach().numpy().copy()  # numpy: tensors cannot outlive the process
        offloaded = trainer.offload.offloaded_bytes if trainer.offload is not None else 0
        # FSDP units: one per block (gathered just before it runs, freed after) and the root
        units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
        out.append({"loss": float(total), "grads": grads, "offloaded": offloaded, "units": units})
    return out


def _native(ring: int, **train: Any) -> str:
    return tiny_spec(
        data={"kind": "passkey", "seq_len": 192, "key_digits": 3, "answer_weight": 4.0},
        parallel={"ring_size": ring, "data_parallel": 1, "layout": "zigzag"},
        train=train,
    ).model_dump_json()


def _compare(runs: list[dict[str, Any]], what: list[str]) -> None:
    ref = runs[0]
    as_tensors = [{k: torch.from_numpy(v) for k, v in run["grads"].items()} for run in runs]
    runs = [{**run, "grads": grads} for run, grads in zip(runs, as_tensors, strict=True)]
    ref = runs[0]
    for run, name in zip(runs[1:], what[1:], strict=True):
        assert run["loss"] == pytest.approx(ref["loss"], rel=RTOL), name
        assert run["grads"].keys() == ref["grads"].keys()
        for key, g in ref["grads"].items():
            scale = float(g.abs().max())
            assert scale > 0, key  # a zero gradient would compare equal to anything
            # tiles reorder the sum over tokens of a weight gradient: ~1e-7 of the tensor's scale (measured)
            atol = ATOL_OF_SCALE * scale
            torch.testing.assert_close(
                run["grads"][key], g, rtol=RTOL, atol=atol, msg=f"{key}, {name}"
            )


@pytest.mark.multiprocess
@pytest.mark.parametrize("ring", [1, 2, 3])
def test_knobs_give_the_same_loss_and_gradients(ring):
    specs = [_native(ring, **k) for k in KNOBS]
    per_rank = (
        run_distributed(_grads, ring, specs, False) if ring > 1 else [_grads(0, 1, specs, False)]
    )
    _compare(per_rank[0], [str(k) for k in KNOBS])
    n_layers = JobSpec.model_validate_json(specs[0]).model.n_layers
    for rank in per_rank:  # one process shards nothing
        assert [run["units"] for run in rank] == [n_layers + 1 if ring > 1 else 0] * len(KNOBS)


def _docs_spec(corpus: Any, ulysses: int, **train: Any) -> str:
    return tiny_spec(
        data={"kind": "text", "path": str(corpus), "seq_len": 96, "pack": "documents"},
        parallel={"ring_size": 2, "ulysses_size": ulysses, "data_parallel": 1, "layout": "zigzag"},
        train=train,
    ).model_dump_json()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["ring 4", "ulysses 2 x ring 2, packed documents"])
def test_knobs_are_exact_on_four_ranks_with_ulysses_and_packed_documents(shape, tmp_path):
    """The knobs on a ring of 4, and on Ulysses x ring over packed documents (per-document
    attention inside every tile and every recomputed block): each against the plain run."""
    knobs = [k for k in KNOBS if k != {"tiled_mlp": 4, "activation_checkpointing": "selective"}]
    if shape == "ring 4":
        specs = [_native(4, **k) for k in knobs]
    else:
        corpus = tmp_path / "docs.jsonl"
        docs = [
            f"document {i}: " + " ".join(f"w{(i * 7 + j) % 23}" for j in range(5 + 9 * (i % 5)))
            for i in range(40)
        ]
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        specs = [_docs_spec(corpus, 2, **k) for k in knobs]
    per_rank = run_distributed(_grads, 4, specs, False)
    _compare(per_rank[0], [str(k) for k in knobs])


@pytest.mark.multiprocess
def test_offload_mechanism_is_exact_and_moves_every_block_input():
    """Full checkpointing with the block inputs released to host memory and restored in backward (CPU copies)."""
    specs = [
        _native(2, activation_checkpointing="full"),
        _native(2, activation_checkpointing="full", tiled_mlp=2),
    ]
    plain = run_distributed(_grads, 2, specs, False)
    moved = run_distributed(_grads, 2, specs, True)
    for r in range(2):
        _compare([plain[r][0], moved[r][0]], ["full", "full+offload"])
        _compare([plain[r][0], moved[r][1]], ["full", "full+tiled+offload"])
        # two blocks of [2 sequences, 96 local tokens, 32] fp32 inputs went to the host
        assert moved[r][0]["offloaded"] == 2 * 2 * 96 * 32 * 4


@pytest.mark.multiprocess
def test_knobs_on_a_pretrained_model(tmp_path):
    model_dir, corpus = tmp_path / "qwen", tmp_path / "corpus.txt"
    write_checkpoint(model_dir, "qwen2", tie_word_embeddings=True)
    corpus.write_text(CORPUS)

    def spec(**train: Any) -> str:
        return tiny_spec(
            model={"kind": "hf", "path": str(model_dir)},
            data={"kind": "text", "path": str(corpus), "seq_len": 96},
            parallel={"ring_size": 2, "data_parallel": 1, "layout": "zigzag"},
            train=train,
        ).model_dump_json()

    knobs = [
        {},
        {"activation_checkpointing": "full", "tiled_mlp": "auto"},
        {"activation_checkpointing": "selective"},
        {"tiled_mlp": 5},
    ]
    per_rank = run_distributed(_grads, 2, [spec(**k) for k in knobs], False)
    _compare(per_rank[0], [str(k) for k in knobs])


def test_knob_validation():
    assert (
        tiny_spec(train={"activation_checkpointing": True}).train.activation_checkpointing == "full"
    )
    assert (
        tiny_spec(train={"activation_checkpointing": False}).train.activation_checkpointing
        == "none"
    )
    for bad in (
        {"activation_checkpointing": "some"},
        {"tiled_mlp": 0},
        {"tiled_mlp": True},
        {"tiled_mlp": "on"},
    ):
        with pytest.raises(ValidationError) as e:
            tiny_spec(train=bad)
        assert e.value.errors()[0]["loc"][:2] == ("train", next(iter(bad))), e.value.errors()
    for resources, train in (
        ({"accelerator": "cpu"}, {"offload_activations": True, "activation_checkpointing": "full"}),
        ({"accelerator": "gpu"}, {"offload_activations": True}),
    ):
        raw = tiny_spec().model_dump(mode="json")
        raw["train"].update(train)
        raw["resources"].update(resources)
        with pytest.raises(ValidationError) as e:
            JobSpec.model_validate(raw)
        assert e.value.errors()[0]["loc"] == ("train", "offload_activations")
    ok = tiny_spec(train={"offload_activations": True, "activation_checkpointing": "full"})
    assert (
        ok.train.offload_activations
    )  # accelerator auto: refused at run time where no GPU is found
    assert mlp_tiles("off", 8192, 512) == 1 and mlp_tiles("auto", 8192, 512) == 16
    assert mlp_tiles(7, 8192, 512) == 7 and mlp_tiles(64, 10, 512) == 10


def test_offload_is_refused_at_run_time_without_cuda():
    from workers.training.trainer import Trainer

    spec = tiny_spec(train={"offload_activations": True, "activation_checkpointing": "full"})
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="offload_activations"):
        Trainer(spec, checkpoint_dir=None, emit=lambda p: None, device=torch.device("cpu"))
