"""`data.pack: documents`: whole documents per sequence, positions restart, labels never cross a boundary,
the same global batch on any layout, and a loss through ring attention equal to running every document
on its own (which fails if attention crosses a document boundary or positions do not restart)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_cases import reference_attention
from tests.support.dist import run_distributed
from workers.attention import ring_attention, unshard_sequence
from workers.data.batch import take_shard
from workers.data.pack import PackedTextSource, pack_sequences
from workers.data.tokenizer import ByteTokenizer

SEQ = 72


def _corpus(tmp: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    words = ["ring", "zigzag", "stripe", "token", "a", "document", "boundary", "x"]
    rows = []
    for _i in range(40):
        n = int(
            torch.randint(0, 5, (), generator=g)
        )  # some documents are empty: eos only (length 1)
        rows.append(
            {
                "text": " ".join(
                    words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g)
                )
            }
        )
    rows.append({"text": "long " * 40})  # longer than SEQ: cut into pieces
    path = tmp / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_packing_properties(tmp_path: Path) -> None:
    src = PackedTextSource(_corpus(tmp_path), SEQ, seed=3)
    n_seq = len(src._epoch(0))
    seen = []
    for g in range(n_seq):
        inputs, labels, weights, pos, bounds = src.sequence(g)
        assert bounds[0] == 0 and bounds[-1] == SEQ and bounds == sorted(bounds)
        for a, b in itertools.pairwise(bounds):
            assert pos[a:b].tolist() == list(range(b - a))  # positions restart in every document
            assert weights[b - 1] == 0  # the last token of a document has no label
            assert torch.equal(
                labels[a : b - 1][weights[a : b - 1] > 0], inputs[a + 1 : b][weights[a : b - 1] > 0]
            )
        seen.extend(src._epoch(0)[g])
    # every piece exactly once per epoch, whole
    assert sorted(seen) == list(range(len(src.pieces)))
    assert all(len(p) <= SEQ for p in src.pieces) and any(len(p) == 1 for p in src.pieces)
    eos = ByteTokenizer.eos_id
    assert all(int(p[-1]) == eos for p in src.pieces if len(p) < SEQ)
    # labels are inputs shifted within documents: total labelled tokens = tokens - documents (- padding)
    total = sum(float(src.sequence(g)[2].sum()) for g in range(n_seq))
    assert total == src.n_tokens - len(src.pieces)


def test_batch_cu_seqlens_and_resume(tmp_path: Path) -> None:
    path = _corpus(tmp_path)
    src = PackedTextSource(path, SEQ, seed=5)
    b = src.global_batch(4, 3)  # crosses into the second epoch for this corpus size
    cu = b.cu_seqlens
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == 3 * SEQ
    assert {0, SEQ, 2 * SEQ} <= set(cu.tolist())
    q = torch.randn(3, SEQ, 2, 4)
    ring_attention(q, q, q, cu_seqlens=cu)  # accepted as is
    again = PackedTextSource(path, SEQ, seed=5)
    again.load_state_dict(src.state_dict())
    b2 = again.global_batch(4, 3)
    for f in ("inputs", "labels", "weights", "cu_seqlens", "doc_positions"):
        assert torch.equal(getattr(b, f), getattr(b2, f)), f
    with pytest.raises(ValueError, match="seed"):
        PackedTextSource(path, SEQ, seed=6).load_state_dict(src.state_dict())


def test_next_fit() -> None:
    assert pack_sequences([3, 4, 2, 5, 1], [0, 1, 2, 3, 4], 8) == [[0, 1], [2, 3, 4]]


def _tiny_loss(inputs, pos, labels, weights, cu, layout, group):  # type: ignore[no-untyped-def]
    """Embedding + sinusoidal document positions -> one ring-attention layer -> weighted CE sum."""
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(256, 16, generator=g, dtype=torch.float64)
    wq, wk, wv = (torch.randn(16, n * 8, generator=g, dtype=torch.float64) * 0.3 for n in (2, 1, 1))
    head = torch.randn(16, 256, generator=g, dtype=torch.float64)
    x = emb[inputs] + torch.sin(
        pos.double()[..., None] * torch.linspace(0.1, 1.0, 16, dtype=torch.float64)
    )
    b, s, _ = x.shape
    q, k, v = (x @ w for w in (wq, wk, wv))
    q, k, v = q.reshape(b, s, 2, 8), k.reshape(b, s, 1, 8), v.reshape(b, s, 1, 8)
    if cu is None:
        att = reference_attention(q, k, v, True)
    else:
        att = ring_attention(q, k, v, causal=True, layout=layout, group=group, cu_seqlens=cu)
    logits = att.reshape(b, s, 16) @ head
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 256), labels.reshape(-1), reduction="none"
    )
    return (ce * weights.reshape(-1).double()).sum()


def packed_loss_vs_documents(rank: int, world: int, path: str, layouts: list[str]) -> list[dict]:
    src = PackedTextSource(path, SEQ, seed=1)
    batch = src.global_batch(2, 4)
    out = []
    for layout in layouts:
        local = take_shard(batch, dp_index=0, dp_size=1, layout=layout, ring_group=dist.group.WORLD)
        loss = _tiny_loss(
            local.inputs,
            local.doc_positions,
            local.labels,
            local.weights,
            local.cu_seqlens,
            layout,
            None,
        )
        dist.all_reduce(loss)
        # every field reassembles to the global batch
        same = all(
            torch.equal(unshard_sequence(getattr(local, f), 1, layout), getattr(batch, f))
            for f in ("inputs", "labels", "weights", "doc_positions")
        )
        out.append({"layout": layout, "loss": loss.item(), "reassembles": same})
    # reference: every document alone, single process, positions from 0
    ref = torch.zeros((), dtype=torch.float64)
    for row in range(4):
        _, _, _, _, bounds = src.sequence(8 + row)
        for a, b in itertools.pairwise(bounds):
            sl = slice(a, b)
            ref += _tiny_loss(
                batch.inputs[row : row + 1, sl], torch.arange(b - a)[None], batch.labels[row : row + 1, sl],
                batch.weights[row : row + 1, sl], None, "", None,
            )  # fmt: skip
    return [{**o, "ref": ref.item()} for o in out]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 3])
def test_packed_loss_equals_documents_alone(world: int, tmp_path: Path) -> None:
    path = str(_corpus(tmp_path))
    for per_rank in run_distributed(
        packed_loss_vs_documents, world, path, ["zigzag", "striped", "contiguous"]
    ):
        for res in per_rank:
            assert res["reassembles"], res
            assert abs(res["loss"] - res["ref"]) <= 1e-10 * abs(res["ref"]), res


def test_the_loss_check_catches_leaks(tmp_path: Path) -> None:
    """The equality above is not vacuous: attending across documents, or positions that do not restart,
    change this batch's loss."""
    src = PackedTextSource(_corpus(tmp_path), SEQ, seed=1)
    b = src.global_batch(2, 4)
    assert len(b.cu_seqlens) > 4 + 4  # several documents per row
    good = _tiny_loss(b.inputs, b.doc_positions, b.labels, b.weights, b.cu_seqlens, "zigzag", None)
    rows_only = torch.arange(0, 4 * SEQ + 1, SEQ, dtype=torch.int32)
    leaky = _tiny_loss(b.inputs, b.doc_positions, b.labels, b.weights, rows_only, "zigzag", None)
    global_pos = torch.arange(SEQ).expand(4, SEQ)
    unrestarted = _tiny_loss(
        b.inputs, global_pos, b.labels, b.weights, b.cu_seqlens, "zigzag", None
    )
    assert abs(leaky - good) > 1e-3 * abs(good) and abs(unrestarted - good) > 1e-3 * abs(good)
