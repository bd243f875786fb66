"""`data prepare` planning and writing guards the fast tier lacked (workers/data/prepare/planning.py,
writing.py, run.py): which files a directory holds, where jsonl chunks are cut and the line numbers
they start at, the manifest's names and counts, the token dtype, and what makes two prepares the
same dataset. Everything is in process (`inline=True`) on byte-level corpora of a few hundred
bytes; the expected values are counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.data.prepare import PrepareError, list_sources, plan_dataset, plan_file, prepare
from workers.data.prepare.writing import dtype_for


def test_a_directory_lists_its_corpus_files_whatever_the_suffix_case(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("b.JSONL", "a.txt", "sub/c.Parquet", "notes.md", "sub/d.jsonl"):
        (tmp_path / name).write_text("x")
    root, files = list_sources(tmp_path)
    assert root == tmp_path
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "a.txt",
        "b.JSONL",
        "sub/c.Parquet",
        "sub/d.jsonl",
    ]


def test_jsonl_chunks_end_at_the_first_line_end_reaching_chunk_bytes(tmp_path: Path) -> None:
    """Lines of exactly 10 bytes and chunk_bytes 20: every chunk is two whole lines, and knows the
    number of its first line."""
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(f'{{"t": {i}}}\n' for i in range(10, 17)))  # 10 bytes a line
    assert path.stat().st_size == 70
    planned = plan_file(0, path, tmp_path, 20)
    assert [(c.start, c.stop, c.first_line, c.size) for c in planned.chunks] == [
        (0, 20, 1, 20),
        (20, 40, 3, 20),
        (40, 60, 5, 20),
        (60, 70, 7, 10),
    ]
    assert [c.part for c in planned.chunks] == [0, 1, 2, 3]


def test_a_bad_line_in_a_later_chunk_is_named_by_its_own_number(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"row {i}"}) for i in range(9)]
    lines[6] = '{"text": broken'
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PrepareError, match=r"c\.jsonl:7: not a JSON object"):
        prepare(src, tmp_path / "ds", chunk_bytes=40, inline=True)


def test_the_manifest_names_files_by_their_path_under_the_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "part").mkdir(parents=True)
    (src / "a.jsonl").write_text('{"text": "abc"}\n{"text": "de"}\n')
    (src / "part" / "a.jsonl").write_text('{"text": "fghij"}\n')
    m = prepare(src, tmp_path / "ds", inline=True)
    assert [(f["path"], f["documents"], f["tokens"], f["bytes"]) for f in m["files"]] == [
        ("a.jsonl", 2, 4 + 3, 31),
        ("part/a.jsonl", 1, 6, 18),
    ]
    assert (m["documents"], m["tokens"], m["bytes"]) == (3, 13, 49)
    assert (m["format"], m["text_field"], m["dtype"]) == ("text", "text", "uint8")


def test_token_dtype_is_the_smallest_that_holds_every_id() -> None:
    assert [dtype_for(n) for n in (2, 256, 257, 65536, 65537)] == [
        "uint8",
        "uint8",
        "uint16",
        "uint16",
        "uint32",
    ]


def test_the_dataset_id_follows_the_text_field_and_the_file_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "abc", "body": "xyz"}\n')
    base = plan_dataset(src).dataset_id
    assert plan_dataset(src).dataset_id == base  # a content address: the same plan, the same id
    assert plan_dataset(src, text_field="body").dataset_id != base
    (src / "a.jsonl").rename(src / "b.jsonl")
    assert plan_dataset(src).dataset_id != base


def test_a_prepare_into_a_dataset_of_another_source_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    first, second = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first.write_text('{"text": "first"}\n')
    second.write_text('{"text": "second one"}\n')
    assert prepare(first, out, inline=True)["tokens"] == 6
    replaced = prepare(second, out, inline=True)
    assert replaced["tokens"] == 11 and replaced["id"] == plan_dataset(second).dataset_id
    assert json.loads((out / "manifest.json").read_text())["tokens"] == 11


def test_an_empty_existing_directory_may_be_the_output(tmp_path: Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "abc"}\n')
    out = tmp_path / "ds"
    out.mkdir()
    assert prepare(src, out, inline=True)["documents"] == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(PrepareError, match="refusing to replace it"):
        prepare(src, other, inline=True)


def test_progress_reaches_every_byte_with_shared_and_reused_files(tmp_path: Path) -> None:
    """Files with identical content share shards, unchanged files are linked from the last
    version: the tokenizing progress still counts their bytes, so it ends at the total."""
    from workers.data.prepare import Progress

    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.jsonl", "b.jsonl"):  # the same content: one set of shards
        (src / name).write_text('{"text": "same"}\n')
    (src / "c.jsonl").write_text('{"text": "other"}\n')
    seen: list[Progress] = []
    prepare(src, tmp_path / "ds", inline=True, progress=seen.append)
    last = [p for p in seen if p.stage == "tokenizing"][-1]
    assert last.done_bytes == last.total_bytes == 17 + 17 + 18
    (src / "c.jsonl").write_text('{"text": "changed"}\n')  # a and b are linked, c tokenized
    seen.clear()
    prepare(src, tmp_path / "ds", inline=True, progress=seen.append)
    tokenizing = [p for p in seen if p.stage == "tokenizing"]
    assert tokenizing[0].done_bytes == 34  # the linked files, before any tokenizing
    assert tokenizing[-1].done_bytes == tokenizing[-1].total_bytes == 34 + 20


def test_errors_of_several_chunks_are_one_message(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": 1}\n')
    (src / "b.jsonl").write_text('{"text": 2}\n')  # another content: its own chunk, its own error
    (src / "c.jsonl").write_text('{"text": "ok"}\n')
    with pytest.raises(PrepareError) as e:
        prepare(src, tmp_path / "ds", inline=True)
    assert str(e.value).endswith("got int (and 1 more)") and "a.jsonl:1" in str(e.value)
    with pytest.raises(PrepareError, match="--format must be 'text' or 'chat', got 'json'"):
        plan_dataset(src, fmt="json")


def test_a_lost_shard_of_an_unchanged_file_is_tokenized_again(tmp_path: Path) -> None:
    """Re-preparing after one file changed links the others' shards from the last version, unless
    a shard is gone: then that file is tokenized again, and every document reads back."""
    from workers.data import open_dataset

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"body": "alpha"}\n')
    (src / "b.jsonl").write_text('{"body": "beta"}\n')
    out = tmp_path / "ds"
    first = prepare(src, out, text_field="body", inline=True)
    assert first["text_field"] == "body"
    a_key = first["files"][0]["key"]
    for shard in (out / "shards").glob(f"{a_key}-*.tokens.npy"):
        shard.unlink()
    (src / "b.jsonl").write_text('{"body": "beta two"}\n')
    prepare(src, out, text_field="body", inline=True)
    ds = open_dataset(out)
    assert [bytes(ds[i]["tokens"].tolist()) for i in range(len(ds))] == [b"alpha\0", b"beta two\0"]
