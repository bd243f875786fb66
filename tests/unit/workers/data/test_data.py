"""Data: byte tokenizer, passkey samples, text corpora, layout-independent global batches.

Text corpora are read as jobs read them: `build_source` of a `kind: text` spec, a `CachedTextSource`
(prepared once into the data cache, here under tmp_path, and read by `TokensSource`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.trainutil import one_thread, series, source_of, tiny_spec
from workers.data import (
    ByteTokenizer,
    CachedTextSource,
    PasskeySource,
    from_windows,
    make_sample,
    sample_generator,
    take_shard,
)
from workers.data.passkey import NEEDLE, QUESTION
from workers.training.trainer import run_training

assert one_thread  # autouse fixture, imported to apply to this module


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "pass key: 12345 — ünïcode ✓"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text and tok.decode(tok.encode_tensor(text)) == text


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_key_sits_at_requested_depth(depth):
    seq_len, digits = 1024, 6
    s = make_sample(seq_len, digits, depth, sample_generator(3, 1, 2), answer_weight=5.0)
    text = ByteTokenizer().decode(s.tokens)
    assert (
        len(s.tokens) == seq_len + 1
        and len(s.key) == digits
        and s.key.isdigit()
        and s.key[0] != "0"
    )
    needle = NEEDLE.format(key=s.key)
    at = text.index(needle)
    assert at == s.needle_start
    assert text.endswith(QUESTION + s.key)  # question last, answer tokens last
    # depth = needle offset inside the haystack (between the intro and the question)
    haystack_start = text.index("Find it and remember it. ") + len("Find it and remember it. ")
    haystack_len = len(text) - haystack_start - len(needle) - len(QUESTION) - digits
    assert abs((at - haystack_start) / haystack_len - depth) < 2 / haystack_len
    # weights: answer_weight on exactly the answer labels, 1 elsewhere
    assert s.weights.shape == (seq_len,)
    assert torch.all(s.weights[-digits:] == 5.0) and torch.all(s.weights[:-digits] == 1.0)
    assert (
        ByteTokenizer().decode(s.tokens[1:][s.answer_start :]) == s.key
    )  # labels at answer_start.. = key


@pytest.mark.parametrize(("seq_len", "digits"), [(64, 1), (64, 3), (80, 5), (320, 20)])
def test_passkey_fits_the_shortest_lengths_the_spec_allows(seq_len, digits):
    s = make_sample(seq_len, digits, 0.5, sample_generator(0, 0))
    text = ByteTokenizer().decode(s.tokens)
    assert len(s.tokens) == seq_len + 1 and text.endswith(s.key) and text.count(s.key) >= 2


def test_passkey_random_depth_and_keys_vary_but_are_deterministic():
    src = PasskeySource(512, 5, None, 1.0, seed=11)
    a, b = src.global_batch(4, 8), src.global_batch(4, 8)
    assert torch.equal(a.inputs, b.inputs)
    keys = {make_sample(512, 5, None, sample_generator(11, 4, i)).key for i in range(8)}
    depths = {make_sample(512, 5, None, sample_generator(11, 4, i)).needle_start for i in range(8)}
    assert len(keys) == 8 and len(depths) > 4
    assert not torch.equal(src.global_batch(5, 8).inputs, a.inputs)
    assert not torch.equal(
        PasskeySource(512, 5, None, 1.0, seed=12).global_batch(4, 8).inputs, a.inputs
    )
    # labels are the inputs shifted on the global sequence
    assert torch.equal(a.inputs[:, 1:], a.labels[:, :-1])


def test_global_batch_does_not_depend_on_the_parallel_layout():
    specs = [
        tiny_spec(
            parallel={"ring_size": r, "data_parallel": d, "layout": lay}, train={"batch_size": 4}
        )
        for r, d, lay in [
            (1, 1, "zigzag"),
            (4, 1, "zigzag"),
            (2, 2, "striped"),
            (3, 1, "contiguous"),
        ]
    ]
    batches = [source_of(s).global_batch(9, 4) for s in specs]
    for b in batches[1:]:
        assert torch.equal(b.inputs, batches[0].inputs) and torch.equal(
            b.weights, batches[0].weights
        )
    dp = [
        take_shard(batches[0], dp_index=i, dp_size=2, layout="zigzag", ring_group=None)
        for i in range(2)
    ]
    assert torch.equal(torch.cat([d.inputs for d in dp]), batches[0].inputs)


@pytest.fixture
def data_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh data cache under tmp_path for the `kind: text` corpora of a test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RINGTRAIN_DATA_CACHE", str(root))
    return root


def _write_corpora(tmp_path):
    docs = [
        f"document {i}: " + " ".join(str(j * j * 7 + i) for j in range(40 + 3 * i))
        for i in range(12)
    ]
    (tmp_path / "c.txt").write_text("\x00".join(docs))
    (tmp_path / "c.jsonl").write_text(
        "\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs}), tmp_path / "c.parquet")
    return docs


def _text_source(path: Path, seq_len: int, seed: int, text_field: str = "text") -> CachedTextSource:
    """The source a `kind: text`, `pack: windows` job over `path` reads."""
    data = {"kind": "text", "path": str(path), "seq_len": seq_len, "text_field": text_field}
    src = source_of(tiny_spec(data={**data, "pack": "windows"}, train={"seed": seed}))
    assert isinstance(src, CachedTextSource) and src.pack == "windows"
    return src


def _stream(src: CachedTextSource) -> bytes:
    """The source's whole token stream (every document closed by eos), as bytes."""
    tokens, _ = src.ds.read(0, src.ds.num_tokens)
    return np.asarray(tokens, dtype=np.uint8).tobytes()


def test_text_corpora_pack_deterministically_and_resume(tmp_path, data_cache):
    docs = _write_corpora(tmp_path)
    seq_len = 64
    sources = [
        _text_source(tmp_path / "c.txt", seq_len, seed=1),
        _text_source(tmp_path / "c.jsonl", seq_len, seed=1, text_field="body"),
        _text_source(tmp_path / "c.parquet", seq_len, seed=1, text_field="body"),
    ]
    assert all(s.ds.path.parent == data_cache for s in sources)
    # all three formats yield the same flat stream (documents joined by NUL, the last one closed by it
    # too), so the same windows and the same batches
    stream = ("\x00".join(docs) + "\x00").encode()
    for s in sources:
        assert _stream(s) == stream and s.n_windows == sources[0].n_windows
    for s in sources[1:]:
        assert torch.equal(s.global_batch(2, 4).inputs, sources[0].global_batch(2, 4).inputs)
    src = sources[0]
    assert src.n_windows == (len(stream) - 1) // seq_len
    # One epoch visits every window exactly once, in a seeded order.
    steps = src.n_windows // 2
    seen = torch.cat([src.global_batch(step, 2).inputs for step in range(steps)])
    windows = {stream[w * seq_len : (w + 1) * seq_len]: w for w in range(src.n_windows)}
    assert (
        len(windows) == src.n_windows
    )  # the corpus has no repeated windows, so rows identify windows
    visited = [windows[bytes(row.tolist())] for row in seen]
    assert len(set(visited)) == len(visited) == 2 * steps and visited != sorted(visited)
    b = src.global_batch(3, 2)
    assert torch.equal(b.inputs[:, 1:], b.labels[:, :-1]) and b.inputs.shape == (2, seq_len)
    for inputs, labels in zip(b.inputs, b.labels, strict=True):  # a window is seq_len + 1 tokens
        at = windows[bytes(inputs.tolist())] * seq_len + 1
        assert bytes(labels.tolist()) == stream[at : at + seq_len]
    # Resumable: a fresh source restored from the state produces the same next batch.
    state = src.state_dict()
    assert state["kind"] == "text" and state["samples_consumed"] == 8
    fresh = _text_source(tmp_path / "c.txt", seq_len, seed=1)
    fresh.load_state_dict(state)
    assert fresh.samples_consumed == src.samples_consumed
    assert torch.equal(fresh.global_batch(7, 2).inputs, src.global_batch(7, 2).inputs)
    # Different seed: different order, and the state is refused. Different corpus: refused too.
    other_seed = _text_source(tmp_path / "c.txt", seq_len, seed=2)
    assert not torch.equal(
        other_seed.global_batch(0, 4).inputs,
        _text_source(tmp_path / "c.txt", seq_len, seed=1).global_batch(0, 4).inputs,
    )
    with pytest.raises(ValueError, match="seed or packing changed"):
        other_seed.load_state_dict(state)
    (tmp_path / "d.txt").write_text("other text " * 100)
    with pytest.raises(ValueError, match="dataset, seed or packing changed"):
        _text_source(tmp_path / "d.txt", seq_len, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer training tokens than seq_len"):
        _text_source(tmp_path / "d.txt", 4096, seed=1)


def _reassemble(rank: int, world: int) -> bool:
    """On every layout, the ranks' shards (inputs, labels, weights) unshard to the global batch."""
    import torch.distributed as dist

    from workers.attention import unshard_sequence

    batch = PasskeySource(240, 4, 0.3, 3.0, seed=5).global_batch(0, 2)
    group = dist.new_group(list(range(world)))
    for layout in ("contiguous", "zigzag", "striped"):
        local = take_shard(batch, dp_index=0, dp_size=1, layout=layout, ring_group=group)
        assert local.inputs.shape == (2, 240 // world)
        for full, part in [
            (batch.inputs, local.inputs),
            (batch.labels, local.labels),
            (batch.weights, local.weights),
        ]:
            assert torch.equal(unshard_sequence(part, 1, layout, group), full)
        # label of a shard's last token is the *global* next token, wherever it lives
        pos = local.positions
        ok = pos < 239
        assert torch.equal(local.labels[:, ok], batch.inputs[:, pos[ok] + 1])
    return True


@pytest.mark.multiprocess
def test_shards_reassemble_to_the_global_sequence():
    assert run_distributed(_reassemble, 3) == [True, True, True]


def test_from_windows_default_weights():
    b = from_windows(torch.arange(10).view(2, 5))
    assert b.inputs.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and b.labels.tolist() == [
        [1, 2, 3, 4],
        [6, 7, 8, 9],
    ]
    assert torch.equal(b.weights, torch.ones(2, 4)) and b.positions.tolist() == [0, 1, 2, 3]


def test_loss_decreases_on_a_small_passkey_run():
    spec = tiny_spec(
        model={"d_model": 64},
        data={"seq_len": 128, "answer_weight": 1.0},
        train={"steps": 40, "batch_size": 4, "lr": 1e-2, "warmup_steps": 4},
    )
    points = []
    run_training(spec, checkpoint_dir=None, emit=points.append)
    loss = series([p.model_dump() for p in points], "loss")
    assert len(loss) == 40
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    assert first > 4.5  # ≈ ln 256 at init
    assert last < 0.6 * first, (
        first,
        last,
    )  # filler is predictable: a working model learns it quickly


def test_text_job_trains_and_resumes_its_data_position(tmp_path, data_cache):
    _write_corpora(tmp_path)
    spec = tiny_spec(
        data={
            "kind": "text",
            "seq_len": 64,
            "path": str(tmp_path / "c.jsonl"),
            "text_field": "body",
        },
        train={"steps": 4, "batch_size": 2, "warmup_steps": 0},
    )
    points = []
    first = run_training(spec, checkpoint_dir=tmp_path / "ck", emit=points.append, max_steps=2)
    second = run_training(spec, checkpoint_dir=tmp_path / "ck", emit=points.append)
    assert (first.final_step, second.resumed_from, second.final_step) == (2, 2, 4)
    assert (data_cache / "index").is_dir()  # the job read the corpus through the cache
    state = torch.load(tmp_path / "ck" / "step-000004" / "state.pt", weights_only=False)
    assert state["data"]["samples_consumed"] == 8 and state["data"]["kind"] == "text"
    loss = series([p.model_dump() for p in points], "loss")
    assert len(loss) == 4 and all(0 < v < 7 for v in loss)
