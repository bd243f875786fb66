"""Prepared datasets: `python -m workers.data.prepare` on the session's Ray head, read back by `open_dataset`.

Every prepare runs as its own process (the CLI, as users run it) against the session Ray head; expected
values come from the tokenizer itself (transformers' encoding, `apply_chat_template`'s assistant mask).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.local_ray import RayHead
from tests.support.hf_fixtures import bpe_tokenizer_json
from workers.data import open_dataset
from workers.data.prepare import PrepareError, list_sources, plan_file, recover
from workers.data.prepare import main as prepare_main

ROOT = Path(__file__).resolve().parents[4]

GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}A: {% generation %}{{ m['content'] }}<|endoftext|>"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)
PLAIN_TEMPLATE = GENERATION_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

CHATS = [
    [
        {"role": "user", "content": "What is the pass key?"},
        {"role": "assistant", "content": "The key is 48213."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "Grass?"},
        {"role": "assistant", "content": "The grass is green."},
    ],
]


def write_tokenizer(out: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(bpe_tokenizer_json()), eos_token="<|endoftext|>"
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    return out


def hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class Prep:
    """`python -m workers.data.prepare ARGS` in process (`main([..., "--in-process"])`: the same
    code path but the Ray tasks, so the fast tier checks every rule in seconds);
    `test_cli_data_prepare_runs_on_ray` checks the Ray run once."""

    def run(self, *args: str | Path) -> subprocess.CompletedProcess[str]:
        argv = list(map(str, args))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = prepare_main([*argv, "--in-process"])
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())

    def ok(self, *args: str | Path) -> dict[str, Any]:
        done = self.run(*args)
        assert done.returncode == 0, done.stderr[-3000:]
        return dict(json.loads(done.stdout.strip().splitlines()[-1])["dataset"])


@pytest.fixture
def local() -> Prep:
    return Prep()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    write_jsonl(
        src / "a.jsonl",
        [{"text": f"document {i} of a: the sky is blue." * (i + 1)} for i in range(5)],
    )
    (src / "b" / "c.txt").write_text("one whole text file,\nwith two lines")
    pq.write_table(
        pa.table({"text": ["parquet one", "parquet two é"]}),
        src / "b" / "d.parquet",
        row_group_size=1,
    )
    (src / "ignored.md").write_text("not a corpus file")
    return src


def expected_texts(src: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in (src / "a.jsonl").read_text().splitlines()]
    texts.append((src / "b" / "c.txt").read_text())
    texts += pq.read_table(src / "b" / "d.parquet").column("text").to_pylist()
    return texts


def test_bytes_text_corpus_in_sorted_order_with_counts(
    local: Prep, corpus: Path, tmp_path: Path
) -> None:
    prep, out = local, tmp_path / "ds"
    summary = prep.ok(corpus, "--tokenizer", "bytes", "--out", out)
    texts = expected_texts(corpus)
    ds = open_dataset(out)
    assert len(ds) == len(texts) == summary["documents"] == 8
    want = [np.asarray([*t.encode("utf-8"), 0]) for t in texts]
    for i, w in enumerate(want):
        item = ds[i]
        np.testing.assert_array_equal(item["tokens"], w)
        assert (
            item["loss_mask"].dtype == np.bool_
            and item["loss_mask"].all()
            and len(item["loss_mask"]) == len(w)
        )
    assert ds.num_tokens == summary["tokens"] == sum(len(w) for w in want)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == ["a.jsonl", "b/c.txt", "b/d.parquet"]
    assert [f["documents"] for f in manifest["files"]] == [5, 1, 2]
    import hashlib

    assert (
        manifest["files"][0]["sha256"]
        == hashlib.sha256((corpus / "a.jsonl").read_bytes()).hexdigest()
    )
    assert manifest["tokenizer"]["kind"] == "bytes"
    start, stop = ds.doc_span(6)
    tokens, mask = ds.read(start - 3, stop + 2)  # across documents and shards
    np.testing.assert_array_equal(tokens, np.concatenate([want[5][-3:], want[6], want[7][:2]]))
    assert mask.all()


def test_hf_text_is_the_tokenizers_own_encoding_and_reprepare_is_a_noop(
    local: Prep, corpus: Path, tmp_path: Path
) -> None:
    prep = local
    tok_dir = write_tokenizer(tmp_path / "tok", None)
    out = tmp_path / "ds"
    first = prep.ok(corpus, "--tokenizer", tok_dir, "--out", out)
    tok = hf(tok_dir)
    ds = open_dataset(out)
    for i, text in enumerate(expected_texts(corpus)):
        want = tok(text)["input_ids"] + [tok.eos_token_id]
        np.testing.assert_array_equal(ds[i]["tokens"], want)
    assert ds.tokenizer["kind"] == "hf" and ds.vocab_size == len(tok)
    inodes = {p.name: p.stat().st_ino for p in (out / "shards").iterdir()}
    created = json.loads((out / "manifest.json").read_text())["created"]

    again = prep.ok(corpus, "--tokenizer", tok_dir, "--out", out)
    assert again["id"] == first["id"]
    assert (
        json.loads((out / "manifest.json").read_text())["created"] == created
    )  # nothing rewritten
    assert {p.name: p.stat().st_ino for p in (out / "shards").iterdir()} == inodes

    # one file changes: only its shards are new, the others are the same files (hard-linked over)
    (corpus / "b" / "c.txt").write_text("a changed text file")
    changed = prep.ok(corpus, "--tokenizer", tok_dir, "--out", out)
    assert changed["id"] != first["id"]
    after = {p.name: p.stat().st_ino for p in (out / "shards").iterdir()}
    kept = [n for n in after if n in inodes]
    assert kept and all(after[n] == inodes[n] for n in kept)
    assert (
        len(after) == len(inodes) and len(kept) == len(inodes) - 2
    )  # c.txt's tokens + offsets are new
    np.testing.assert_array_equal(
        open_dataset(out)[5]["tokens"], tok("a changed text file")["input_ids"] + [tok.eos_token_id]
    )
    assert not list(tmp_path.glob(".ds.*"))


@pytest.mark.parametrize(
    "template", [GENERATION_TEMPLATE, PLAIN_TEMPLATE], ids=["generation", "prefixes"]
)
def test_chat_mask_is_exactly_the_assistant_tokens(tmp_path: Path, template: str) -> None:
    """In process: tokenizing is the same code on Ray (the Ray run is covered by the tests above)."""
    prep = Prep()
    tok_dir = write_tokenizer(tmp_path / "tok", template)
    reference = hf(write_tokenizer(tmp_path / "ref", GENERATION_TEMPLATE))
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "ds"
    prep.ok(src, "--tokenizer", tok_dir, "--out", out, "--format", "chat")
    ds = open_dataset(out)
    assert len(ds) == len(CHATS)
    for i, messages in enumerate(CHATS):
        want = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        np.testing.assert_array_equal(ds[i]["tokens"], want["input_ids"])
        np.testing.assert_array_equal(
            ds[i]["loss_mask"], np.asarray(want["assistant_masks"], dtype=bool)
        )
        assert 0 < ds[i]["loss_mask"].sum() < len(ds[i]["loss_mask"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["mask_rule"] == (
        "generation" if template == GENERATION_TEMPLATE else "prefixes"
    )


def test_many_chunks_equal_one_chunk(tmp_path: Path) -> None:
    """Line-aligned chunks know their first line; cutting changes no document (planning runs without Ray)."""
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * (i % 7 + 1)} for i in range(50)])
    whole = plan_file(0, src, tmp_path, 1 << 30)
    cut = plan_file(0, src, tmp_path, 40)
    assert len(whole.chunks) == 1 and len(cut.chunks) > 5 and whole.sha256 == cut.sha256
    data = src.read_bytes()
    assert b"".join(data[c.start : c.stop] for c in cut.chunks) == data
    for c in cut.chunks:
        assert c.start == 0 or data[c.start - 1 : c.start] == b"\n"
        assert c.first_line == data[: c.start].count(b"\n") + 1


def test_bad_input_names_file_and_line_and_leaves_nothing(local: Prep, tmp_path: Path) -> None:
    prep = local
    tok_dir = write_tokenizer(tmp_path / "tok", GENERATION_TEMPLATE)
    plain_dir = write_tokenizer(tmp_path / "plain", None)
    src = tmp_path / "src"
    src.mkdir()
    good = [{"text": "fine"}] * 3
    write_jsonl(src / "a.jsonl", good)
    bad = src / "b.jsonl"
    bad.write_text(
        json.dumps({"text": "ok"})
        + "\n\n"
        + '{"text": "broken\n'
        + json.dumps({"text": "ok"})
        + "\n"
    )
    out = tmp_path / "ds"
    done = prep.run(src, "--tokenizer", "bytes", "--out", out)
    assert done.returncode == 1 and f"{bad}:3: not a JSON object" in done.stderr

    chat = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[0][:1]}]
    )
    done = prep.run(chat, "--tokenizer", tok_dir, "--out", out, "--format", "chat")
    assert (
        done.returncode == 1 and f"{chat}:2: the conversation has no assistant turn" in done.stderr
    )

    done = prep.run(chat, "--tokenizer", plain_dir, "--out", out, "--format", "chat")
    assert done.returncode == 1 and "has no chat template" in done.stderr
    done = prep.run(chat, "--tokenizer", "bytes", "--out", out, "--format", "chat")
    assert done.returncode == 1 and "chat template" in done.stderr
    done = prep.run(tmp_path / "missing.jsonl", "--tokenizer", "bytes", "--out", out)
    assert (
        done.returncode == 1
        and f"{tmp_path / 'missing.jsonl'}: no such file or directory" in done.stderr
    )
    assert not out.exists() and not list(tmp_path.glob(".ds.*"))

    locked = src / "a.jsonl"
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):  # root reads anything
            return
        with pytest.raises(PrepareError, match=f"{locked}: cannot read it"):
            root, files = list_sources(src)
            plan_file(0, files[0], root, 1 << 20)
    finally:
        locked.chmod(0o644)


def test_an_interrupted_prepare_is_cleaned_up(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    staging, old = tmp_path / ".ds.staging", tmp_path / ".ds.old"
    (staging / "shards").mkdir(parents=True)  # died while tokenizing
    recover(out)
    assert not staging.exists() and not out.exists()
    old.mkdir()
    (old / "manifest.json").write_text(
        "{}"
    )  # died between renaming the old version aside and the new one in
    recover(out)
    assert (out / "manifest.json").exists() and not old.exists()
    old.mkdir()  # died after both renames, before deleting the old version
    recover(out)
    assert out.exists() and not old.exists()


def test_cli_data_prepare_has_the_modules_arguments() -> None:
    import argparse

    from api.cli import parser
    from workers.data.prepare import add_arguments

    module = argparse.ArgumentParser()
    add_arguments(module)
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    data = next(
        a for a in sub.choices["data"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    cli = data.choices["prepare"]
    assert {o for a in module._actions for o in a.option_strings} <= {
        o for a in cli._actions for o in a.option_strings
    }


@pytest.mark.slow
@pytest.mark.ray
def test_cli_data_prepare_runs_on_ray(ray_head: RayHead, tmp_path: Path) -> None:
    """The CLI on Ray: files in sorted path order (a sub-folder, .jsonl, .txt and .parquet, a
    non-default text field), each document the Hugging Face tokenizer's own encoding from the Ray
    tasks (they load it from its directory), the manifest's counts. A bad line named by file and
    line through the Ray tasks, nothing left at --out, is checked once, by the REST prepare on the
    same head (tests/integration/test_datasets_api.py: one Ray Data run fewer); the CLI's exit
    code and message for it by `test_bad_input_names_file_and_line_and_leaves_nothing`."""
    tok_dir = write_tokenizer(tmp_path / "tok", None)
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    rows = ["hello there", "world, é and ü"]
    write_jsonl(src / "b" / "a.jsonl", [{"body": t} for t in rows])
    (src / "a.txt").write_text("a third document\nwith two lines")
    pq.write_table(pa.table({"body": ["parquet one", "parquet two é"]}), src / "b" / "c.parquet")
    texts = ["a third document\nwith two lines", *rows, "parquet one", "parquet two é"]
    env = {**os.environ, **ray_head.client_env(), "PYTHONPATH": str(ROOT)}
    args = [str(src), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "ds")]
    cmd = [sys.executable, "-m", "api.cli", "data", "prepare", *args, "--text-field", "body"]
    # one tokenize task at a time: one worker process loads the tokenizer once for all three files
    cmd += ["--json", "--ray-address", ray_head.gcs_address, "--workers", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    tok = hf(tok_dir)
    want = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert summary["documents"] == 5 and summary["tokens"] == sum(map(len, want))
    ds = open_dataset(tmp_path / "ds")
    for i, w in enumerate(want):
        np.testing.assert_array_equal(ds[i]["tokens"], w)
        assert ds[i]["loss_mask"].all() and len(ds[i]["loss_mask"]) == len(w)
    files = json.loads((tmp_path / "ds" / "manifest.json").read_text())["files"]
    assert [(f["path"], f["documents"]) for f in files] == [
        ("a.txt", 1),
        ("b/a.jsonl", 2),
        ("b/c.parquet", 2),
    ]


def test_identical_files_share_shards_and_count_twice(tmp_path: Path) -> None:
    """In-process (the code each Ray task runs): two files with the same bytes are tokenized once, read twice."""
    from workers.data.prepare import prepare

    src = tmp_path / "src"
    src.mkdir()
    rows = [{"text": "same"}, {"text": "bytes"}]
    write_jsonl(src / "a.jsonl", rows)
    write_jsonl(src / "b.jsonl", rows)
    write_jsonl(src / "c.jsonl", [{"text": "other"}])
    manifest = prepare(src, tmp_path / "ds", tokenizer="bytes", inline=True)
    ds = open_dataset(tmp_path / "ds")
    assert (
        len(ds) == manifest["documents"] == 5 and ds.num_tokens == manifest["tokens"] == 2 * 11 + 6
    )
    assert [bytes(ds[i]["tokens"][:-1].astype(np.uint8)) for i in range(5)] == [
        b"same",
        b"bytes",
    ] * 2 + [b"other"]
    assert manifest["files"][0]["shards"] == manifest["files"][1]["shards"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrepareError, match="is not a prepared dataset"):
        prepare(src, tmp_path / "file", tokenizer="bytes", inline=True)


def test_workers_must_be_positive() -> None:
    """`--workers 0` would start no tokenize task and wait forever: refused by the parser."""
    import argparse

    from workers import prepare_args

    parser = argparse.ArgumentParser()
    prepare_args.add_arguments(parser)
    base = ["src", "--tokenizer", "bytes", "--out", "ds"]
    assert parser.parse_args([*base, "--workers", "3"]).workers == 3
    assert parser.parse_args(base).workers is None
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--workers", "0"])
