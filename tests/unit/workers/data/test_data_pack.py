"""`data.pack: documents`: whole documents per sequence, positions restart, labels never cross a boundary,
the same global batch on any layout, and a loss through ring attention equal to running every document
on its own (which fails if attention crosses a document boundary or positions do not restart).

Sources are built as jobs build them: `build_source` of a `kind: text` spec, a `CachedTextSource` (the
corpus prepared once into the data cache, here under tmp_path, and read by `TokensSource`).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.attention_cases import reference_attention
from tests.support.dist import run_distributed
from tests.support.trainutil import source_of, tiny_spec
from workers.attention import ring_attention, unshard_sequence
from workers.data import CachedTextSource
from workers.data.batch import take_shard
from workers.data.pack import pack_sequences
from workers.data.tokenizer import ByteTokenizer
from workers.data.tokens import Cursor

SEQ = 72
FIELDS = ("inputs", "labels", "weights", "cu_seqlens", "doc_positions")


@pytest.fixture
def data_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh data cache under tmp_path (inherited by the processes `run_distributed` spawns)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RINGTRAIN_DATA_CACHE", str(root))
    return root


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


def _pieces(path: Path) -> list[bytes]:
    """What the corpus should be cut into, computed from the file alone: every document's bytes closed by
    eos, cut into SEQ pieces."""
    eos = bytes([ByteTokenizer.eos_id or 0])
    docs = [json.loads(line)["text"].encode() + eos for line in path.read_text().splitlines()]
    return [d[i : i + SEQ] for d in docs for i in range(0, len(d), SEQ)]


def source(path: str | Path, seed: int) -> CachedTextSource:
    """The source a `kind: text`, `pack: documents` job over `path` reads."""
    spec = tiny_spec(
        data={"kind": "text", "path": str(path), "seq_len": SEQ, "pack": "documents"},
        train={"seed": seed},
    )
    src = source_of(spec)
    assert isinstance(src, CachedTextSource) and src.pack == "documents"
    return src


def epoch_packing(src: CachedTextSource) -> list[list[tuple[int, int]]]:
    """The (document, piece) pairs of each sequence of epoch 0, from the source's own cursors."""
    out, cursor = [], src._cursor(0)
    while cursor.epoch == 0:
        pieces, cursor = src._advance(cursor)
        out.append(pieces)
    return out


def test_packing_properties(tmp_path: Path, data_cache: Path) -> None:
    path = _corpus(tmp_path)
    src = source(path, seed=3)
    assert src.ds.path.parent == data_cache
    packing = epoch_packing(src)
    n_seq = len(packing)
    assert src._cursor(n_seq - 1).epoch == 0 and src._cursor(n_seq).epoch == 1
    eos = ByteTokenizer.eos_id
    seen: list[bytes] = []  # the documents' pieces of every sequence of epoch 0, in order
    for g in range(n_seq):
        inputs, labels, weights, pos, bounds_t = src.sequence(g)
        bounds = bounds_t.tolist()
        assert bounds[0] == 0 and bounds[-1] == SEQ and bounds == sorted(bounds)
        for a, b in itertools.pairwise(bounds):
            assert pos[a:b].tolist() == list(range(b - a))  # positions restart in every document
            assert weights[b - 1] == 0  # the last token of a document has no label
            assert torch.equal(
                labels[a : b - 1][weights[a : b - 1] > 0], inputs[a + 1 : b][weights[a : b - 1] > 0]
            )
        real = bounds[: len(packing[g]) + 1]  # the pieces; the rest (if any) is one padding segment
        assert len(bounds) - len(real) == (real[-1] < SEQ)
        assert not weights[real[-1] :].any() and inputs[real[-1] :].eq(src.pad_id).all()
        seen.extend(bytes(inputs[a:b].tolist()) for a, b in itertools.pairwise(real))
    # every piece exactly once per epoch, whole, in a seeded (not file) order of documents
    want = _pieces(path)
    assert sorted(seen) == sorted(want) and len(seen) == len(want)
    docs = [d for seq in packing for d, _ in seq]
    assert docs != sorted(docs)
    assert all(len(p) <= SEQ for p in seen) and any(len(p) == 1 for p in seen)
    assert all(p[-1] == eos for p in seen if len(p) < SEQ)
    # next-fit: the sequences are `pack_sequences` of the pieces in the order they are visited
    ends = itertools.accumulate(len(seq) for seq in packing)
    groups = [list(range(end - len(seq), end)) for end, seq in zip(ends, packing, strict=True)]
    assert pack_sequences([len(p) for p in seen], list(range(len(seen))), SEQ) == groups
    # labels are inputs shifted within documents: total labelled tokens = tokens - documents (- padding)
    total = sum(float(src.sequence(g)[2].sum()) for g in range(n_seq))
    assert total == src.ds.num_tokens - len(want) == sum(len(p) for p in want) - len(want)


def test_batch_cu_seqlens_and_resume(tmp_path: Path, data_cache: Path) -> None:
    path = _corpus(tmp_path)
    src = source(path, seed=5)
    n_seq = len(epoch_packing(src))
    step = (n_seq - 1) // 3  # its 3 rows hold the last sequence of epoch 0 and the first of epoch 1
    first = 3 * step
    assert first < n_seq <= first + 2 and src._cursor(first + 2).epoch == 1, n_seq
    b = src.global_batch(step, 3)
    cu = b.cu_seqlens
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == 3 * SEQ
    assert {0, SEQ, 2 * SEQ} <= set(cu.tolist())
    q = torch.randn(3, SEQ, 2, 4)
    ring_attention(q, q, q, cu_seqlens=cu)  # accepted as is
    state = src.state_dict()
    assert state["kind"] == "text-documents" and state["samples_consumed"] == first + 3
    assert state["cursor"][:2] == [first + 3, 1]  # where the next sequence starts: in epoch 1
    following = src.global_batch(step + 1, 3)
    again = source(path, seed=5)
    again.load_state_dict(state)
    assert again._last == Cursor(*state["cursor"])  # a resume starts from the cursor, no scan
    b2, b1 = again.global_batch(step + 1, 3), again.global_batch(step, 3)
    for f in FIELDS:
        assert torch.equal(getattr(following, f), getattr(b2, f)), f
        assert torch.equal(getattr(b, f), getattr(b1, f)), f
    with pytest.raises(ValueError, match="seed"):
        source(path, seed=6).load_state_dict(state)


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
    src = source(path, seed=1)  # the corpus is already in the cache: every rank opens it
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
        bounds = src.sequence(8 + row)[4].tolist()
        for a, b in itertools.pairwise(bounds):
            sl = slice(a, b)
            ref += _tiny_loss(
                batch.inputs[row : row + 1, sl], torch.arange(b - a)[None], batch.labels[row : row + 1, sl],
                batch.weights[row : row + 1, sl], None, "", None,
            )  # fmt: skip
    return [{**o, "ref": ref.item()} for o in out]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 3])
def test_packed_loss_equals_documents_alone(world: int, tmp_path: Path, data_cache: Path) -> None:
    path = str(_corpus(tmp_path))
    source(path, seed=1)  # prepared here, once
    for per_rank in run_distributed(
        packed_loss_vs_documents, world, path, ["zigzag", "striped", "contiguous"]
    ):
        for res in per_rank:
            assert res["reassembles"], res
            assert abs(res["loss"] - res["ref"]) <= 1e-10 * abs(res["ref"]), res


def test_the_loss_check_catches_leaks(tmp_path: Path, data_cache: Path) -> None:
    """The equality above is not vacuous: attending across documents, or positions that do not restart,
    change this batch's loss."""
    src = source(_corpus(tmp_path), seed=1)
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
