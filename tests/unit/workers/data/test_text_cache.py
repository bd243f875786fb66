"""`kind: text` through the prepared-dataset cache (workers/data/cache.py): tokenized once, then
read like `kind: tokens`; a second start tokenizes (and hashes) nothing; concurrent starters prepare
once.

Tokenizing and hashing are counted by wrapping `tokenize_chunk` and `plan_file` where the prepare
calls them (`workers.data.prepare.run`: the functions each chunk and each file go through).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import workers.data.prepare.run as prep
from tests.support.trainutil import source_of, tiny_spec
from tests.unit.workers.data.test_tokens_memory import write_corpus
from workers.data import CachedTextSource, TokensSource
from workers.data.cache import cache_root
from workers.data.prepare import PrepareError, prepare

ROOT = Path(__file__).resolve().parents[4]
SEQ = 64


def corpus(root: Path) -> Path:
    src = root / "corpus"
    src.mkdir()
    for name, n in (("a.jsonl", 7), ("b.jsonl", 5)):
        rows = [{"body": f"{name} document {i}: " + "xyz"[i % 3] * (5 + 23 * i)} for i in range(n)]
        (src / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def text_spec(path: Path, pack: str, field: str = "body") -> Any:
    data = {"kind": "text", "path": str(path), "seq_len": SEQ, "pack": pack, "text_field": field}
    return tiny_spec(data=data, train={"batch_size": 3})


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """A fresh cache root, and counters of the chunks tokenized and the files hashed."""
    monkeypatch.setenv("RINGTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    counts = {"tokenized": 0, "hashed": 0}
    tokenize, plan_file = prep.tokenize_chunk, prep.plan_file

    def count_tokenize(row: dict[str, Any]) -> dict[str, Any]:
        counts["tokenized"] += 1
        return tokenize(row)

    def count_hash(*args: Any, **kw: Any) -> Any:
        counts["hashed"] += 1
        return plan_file(*args, **kw)

    monkeypatch.setattr(prep, "tokenize_chunk", count_tokenize)
    monkeypatch.setattr(prep, "plan_file", count_hash)
    return counts


def batches(source: Any, steps: int = 4) -> list[torch.Tensor]:
    return [source.global_batch(s, 3).inputs for s in range(steps)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_second_start_tokenizes_nothing_and_a_changed_file_only_itself(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    src = corpus(tmp_path)
    spec = text_spec(src, "documents")
    first = source_of(spec)
    assert isinstance(first, CachedTextSource) and first.ds.path.parent == cache_root()
    assert counted == {"tokenized": 2, "hashed": 2}
    want = batches(first)

    again = source_of(spec)  # a second start (or another rank): nothing read but the index
    assert counted == {"tokenized": 2, "hashed": 2}
    assert again.ds.id == first.ds.id and same(batches(again), want)

    os.utime(src / "a.jsonl")  # touched, not changed: hashed again, the same dataset
    assert source_of(spec).ds.id == first.ds.id
    assert counted == {"tokenized": 2, "hashed": 4}

    with (src / "b.jsonl").open("a") as f:
        f.write(json.dumps({"body": "a new document"}) + "\n")
    changed = source_of(spec)
    assert counted["tokenized"] == 3  # b only; a's shards come from the previous version
    assert changed.ds.id != first.ds.id and len(changed.ds) == len(first.ds) + 1
    assert first.ds.path.is_dir()  # the version a running job reads is never replaced
    assert sorted(p.name for p in cache_root().iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("pack", ["documents", "windows"])
def test_text_reads_as_tokens_of_the_same_corpus_and_resumes(
    tmp_path: Path, counted: dict[str, int], pack: str
) -> None:
    """The same batches as `kind: tokens` over the corpus prepared by hand (validation 0), and the
    checkpoint state keeps the kind's name."""
    src = corpus(tmp_path)
    text = source_of(text_spec(src, pack))
    prepare(src, tmp_path / "by-hand", tokenizer="bytes", text_field="body", inline=True)
    tokens = TokensSource(tmp_path / "by-hand", SEQ, 7, pack)
    assert same(batches(text), batches(tokens))
    state = text.state_dict()
    assert state["kind"] == ("text" if pack == "windows" else "text-documents")
    resumed = source_of(text_spec(src, pack))
    resumed.load_state_dict(state)
    assert torch.equal(resumed.global_batch(4, 3).inputs, text.global_batch(4, 3).inputs)
    with pytest.raises(ValueError, match="does not apply"):
        resumed.load_state_dict({"kind": "text", "seed": 7, "samples_consumed": 3, "n_tokens": 9})


def test_a_bad_corpus_fails_naming_file_and_line(tmp_path: Path, counted: dict[str, int]) -> None:
    src = corpus(tmp_path)
    (src / "b.jsonl").write_text('{"body": "fine"}\n{"body": broken\n')
    with pytest.raises(PrepareError, match=f"{src / 'b.jsonl'}:2: not a JSON object"):
        source_of(text_spec(src, "documents"))
    assert [p.name for p in cache_root().iterdir()] == ["index"]  # no dataset, no staging
    with pytest.raises(ValueError, match="no such file or directory"):
        source_of(text_spec(tmp_path / "missing.jsonl", "windows"))


OPENER = """
import json, sys, time
from pathlib import Path
import workers.data.prepare.run as prep

count = [0]
tokenize = prep.tokenize_chunk
def counting(row):
    count[0] += 1
    return tokenize(row)
prep.tokenize_chunk = counting

from workers.config import JobSpec
from workers.data import build_source
from workers.models import tokenizer_for

spec = JobSpec.model_validate_json(sys.argv[1])
barrier = Path(sys.argv[2])
(barrier / sys.argv[3]).touch()
while len(list(barrier.iterdir())) < 2:  # both processes imported: open at the same moment
    time.sleep(0.001)
start = time.time()
source = build_source(spec, tokenizer_for(spec))
end = time.time()
inputs = source.global_batch(0, 3).inputs
print(json.dumps({"tokenized": count[0], "start": start, "end": end, "id": source.ds.id,
                  "sum": int(inputs.sum()), "first": inputs[0, :8].tolist()}))
"""


@pytest.mark.slow
def test_two_ranks_starting_together_prepare_once(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(4):  # ~8 MB: long enough that the two opens overlap
        write_corpus(src / f"part-{i}.jsonl", (2 << 20) + i)
    spec = text_spec(src, "documents", "text").model_dump_json()
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RINGTRAIN_DATA_CACHE": str(tmp_path / "c")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, spec, str(barrier), f"rank{r}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    print([{k: o[k] for k in ("tokenized", "start", "end")} for o in outs])
    assert sorted(o["tokenized"] for o in outs) == [0, 4]  # one prepared, the other waited
    a, b = outs
    assert a["start"] < b["end"] and b["start"] < a["end"]  # the opens overlapped
    assert a["id"] == b["id"] and (a["sum"], a["first"]) == (b["sum"], b["first"])
