"""`kind: text` dataset cache (workers/data/cache.py) guards the fast tier lacked: where the cache
lives beside the checkpoint root, that the text field is part of what a cached dataset is, that a
cached directory counts only under the id its index entry names, and that an old failure is tried
again rather than replayed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import workers.data.prepare.run as prep
from workers.data.cache import cache_root, cached_dataset
from workers.data.prepare import PrepareError


def _corpus(root: Path) -> Path:
    """Rows with two text fields of different lengths: `body` 20 + EOS bytes, `title` 5 + EOS."""
    src = root / "corpus.jsonl"
    rows = [{"body": f"body {i:02d} " + "b" * 12, "title": f"t {i:02d}"} for i in range(6)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_cache_root_is_beside_the_job_directories_of_the_checkpoint_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RINGTRAIN_DATA_CACHE", raising=False)
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_DIR", str(tmp_path / "jobs" / "job-7"))
    assert cache_root() == tmp_path.resolve() / "jobs" / ".data-cache"
    monkeypatch.setenv("RINGTRAIN_DATA_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("RINGTRAIN_DATA_CACHE")
    monkeypatch.delenv("RINGTRAIN_CHECKPOINT_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "ringtrain" / "datasets"


def test_another_text_field_of_the_same_corpus_is_another_dataset(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    body = cached_dataset(src, text_field="body", root=tmp_path / "cache")
    title = cached_dataset(src, text_field="title", root=tmp_path / "cache")
    assert body.id != title.id
    assert (len(body), body.num_tokens) == (6, 6 * 21)
    assert (len(title), title.num_tokens) == (6, 6 * 5)
    assert bytes(title[2]["tokens"].tolist()) == b"t 02\0"
    again = cached_dataset(src, text_field="body", root=tmp_path / "cache")
    assert again.id == body.id and bytes(again[0]["tokens"][:7].tolist()) == b"body 00"


def test_a_cached_directory_holding_another_dataset_is_not_reused(tmp_path: Path) -> None:
    """The index names dataset X; its directory now holds a manifest of another id (replaced by
    hand): the start prepares X again instead of reading whatever is there."""
    src = _corpus(tmp_path)
    first = cached_dataset(src, text_field="body", root=tmp_path / "cache")
    manifest_file = first.path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["id"] = "someone-elses"
    manifest_file.write_text(json.dumps(manifest))
    again = cached_dataset(src, text_field="body", root=tmp_path / "cache")
    assert again.id == first.id and again.path == first.path
    assert json.loads(manifest_file.read_text())["id"] == first.id


def test_an_old_failure_is_tried_again_not_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare that failed earlier (a transient error) is recorded in the index; the next start,
    which did not wait on that attempt, prepares again and succeeds."""
    src = _corpus(tmp_path)

    def hiccup(row: dict[str, Any]) -> dict[str, Any]:
        return {"shard": row["shard"], "error": "disk hiccup", "documents": 0, "tokens": 0}

    monkeypatch.setattr(prep, "tokenize_chunk", hiccup)
    with pytest.raises(PrepareError, match="disk hiccup"):
        cached_dataset(src, text_field="body", root=tmp_path / "cache")
    monkeypatch.undo()
    ds = cached_dataset(src, text_field="body", root=tmp_path / "cache")
    assert (len(ds), ds.num_tokens) == (6, 6 * 21)


def test_after_a_failed_prepare_unchanged_files_still_come_from_the_last_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a.jsonl prepared; then b.jsonl added broken (the prepare fails), then fixed: only b is
    tokenized, a's shards are linked from the version before the failure."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "first file"}\n')
    tokenized: list[str] = []
    real = prep.tokenize_chunk

    def counting(row: dict[str, Any]) -> dict[str, Any]:
        tokenized.append(Path(row["chunk"]["path"]).name)
        return real(row)

    monkeypatch.setattr(prep, "tokenize_chunk", counting)
    root = tmp_path / "cache"
    assert cached_dataset(src, root=root).num_tokens == len("first file") + 1
    (src / "b.jsonl").write_text('{"text": broken\n')
    with pytest.raises(PrepareError, match=r"b\.jsonl:1"):
        cached_dataset(src, root=root)
    (src / "b.jsonl").write_text('{"text": "second"}\n')
    tokenized.clear()
    ds = cached_dataset(src, root=root)
    assert tokenized == ["b.jsonl"]
    assert bytes(ds[0]["tokens"].tolist()) == b"first file\0"
    assert bytes(ds[1]["tokens"].tolist()) == b"second\0"


def test_a_text_source_refuses_the_data_position_of_another_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same dataset, seed and packing, but written by a `kind: tokens` job: not this source's."""
    from workers.data import CachedTextSource

    monkeypatch.setenv("RINGTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    src = CachedTextSource(_corpus(tmp_path), 16, seed=3, pack="documents", text_field="body")
    src.global_batch(0, 2)
    state = src.state_dict()
    assert state["kind"] == "text-documents" and state["samples_consumed"] == 2
    with pytest.raises(ValueError, match="does not apply"):
        src.load_state_dict({**state, "kind": "tokens"})
    src.load_state_dict(state)
    assert src.samples_consumed == 2
