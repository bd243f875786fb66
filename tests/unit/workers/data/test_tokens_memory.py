"""A rank's memory does not grow with the corpus: 1 MB and ~80 MB prepared corpora, fresh readers.

A child opens the dataset the way a rank does (`build_source` of a `kind: tokens` spec, and of a
`kind: text` spec over the source, which goes through the prepared cache) and draws a few global
batches. Its peak resident memory is VmHWM after the peak is reset once imports are
done (/proc/self/clear_refs), so torch's import does not mask it; its anonymous memory is sampled
per batch. Shards are memory-mapped, so only the pages a batch touches count; the old in-memory
path held about 10 bytes per corpus byte, which would be ~800 MB here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.trainutil import tiny_spec
from workers.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[4]
SMALL, LARGE = 1 << 20, 80 << 20  # corpus bytes
DOC_BYTES = 16 << 10
SEQ, BATCH, STEPS = 512, 2, 3

CHILD = """
import gc, json, re, sys
from workers.config import JobSpec
from workers.data import build_source
from workers.models import tokenizer_for

def status(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

out = {}
for mode, spec_json in zip(sys.argv[1::2], sys.argv[2::2]):
    spec = JobSpec.model_validate_json(spec_json)
    tokenizer = tokenizer_for(spec)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: imports do not count
    before, anon = status("VmRSS"), status("RssAnon")
    source = build_source(spec, tokenizer)
    total, anon_peak = 0, status("RssAnon")
    for step in range(STEPS):
        batch = source.global_batch(step, spec.train.batch_size)
        total += int(batch.inputs.sum())
        anon_peak = max(anon_peak, status("RssAnon"))
    if mode == "touch-all":  # every mapped page of the corpus read: the measure must see it
        total += sum(int(source.ds._shard(s).tokens.sum()) for s in range(len(source.ds._names)))
    out[mode] = {"peak": (status("VmHWM") - before) << 10, "anon": (anon_peak - anon) << 10}
    del source, batch
print(json.dumps(out))
""".replace("STEPS", str(STEPS))


def write_corpus(path: Path, size: int) -> Path:
    """`size` bytes of jsonl: documents of random lowercase letters (varied lengths, seeded)."""
    rng = np.random.default_rng(size)
    with path.open("w") as f:
        written = 0
        while written < size:
            n = int(rng.integers(DOC_BYTES // 4, DOC_BYTES))
            text = rng.integers(97, 123, size=n, dtype=np.uint8).tobytes().decode("ascii")
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return path


def spec_json(dataset: Path, source: Path, mode: str) -> str:
    """`kind: tokens` over the prepared dataset (a pack, or the control `touch-all`), or
    `kind: text` over the source (`text-first` prepares it into the cache, `text` starts after)."""
    if mode.startswith("text"):
        data = {"kind": "text", "path": str(source), "seq_len": SEQ, "pack": "documents"}
    else:
        pack = "windows" if mode == "touch-all" else mode
        data = {"kind": "tokens", "path": str(dataset), "seq_len": SEQ, "pack": pack}
    return tiny_spec(data=data, train={"batch_size": BATCH}).model_dump_json()


def growth(dataset: Path, source: Path, modes: list[str]) -> dict[str, dict[str, int]]:
    """Per mode (see `spec_json`): the bytes a reader's peak resident memory and its anonymous
    memory rose above the level before opening, measured in one fresh process."""
    args = [a for m in modes for a in (m, spec_json(dataset, source, m))]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    env["RINGTRAIN_DATA_CACHE"] = str(dataset.parent / "cache")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_peak_memory_of_a_reader_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    datasets, sources = {}, {}
    for name, size in (("small", SMALL), ("large", LARGE)):
        sources[name] = write_corpus(tmp_path / f"{name}.jsonl", size)
        datasets[name] = tmp_path / f"{name}-ds"
        manifest = prepare(sources[name], datasets[name], tokenizer="bytes", inline=True)
        assert manifest["tokens"] >= size * 0.95
    modes = ["documents", "windows", "text-first", "text"]
    small = growth(datasets["small"], sources["small"], modes)
    large = growth(datasets["large"], sources["large"], [*modes, "touch-all"])
    # the control: the measure sees mapped pages (reading every shard costs about the corpus)
    assert large["touch-all"]["peak"] > LARGE * 0.8, large
    more = LARGE - SMALL
    # kind: text's first start tokenizes one jsonl chunk (<= 32 MB) at a time: bounded by the chunk
    print(
        f"text, first start (prepares): peak RSS grew {small['text-first']['peak'] / 2**20:.1f} MB "
        f"(1 MB), {large['text-first']['peak'] / 2**20:.1f} MB (80 MB)"
    )
    for pack in ("documents", "windows", "text"):
        s, g = small[pack], large[pack]
        print(
            f"{pack}: peak RSS grew {s['peak'] / 2**20:.1f} MB (1 MB corpus), "
            f"{g['peak'] / 2**20:.1f} MB (80 MB); anonymous {s['anon'] / 2**20:.1f} / "
            f"{g['anon'] / 2**20:.1f} MB"
        )
        # mapped pages count as the kernel maps them (page-cache folios up to 2 MB on ext4), so a
        # reader's peak grows with the places a few batches read, never with the corpus itself
        assert g["peak"] - s["peak"] < more / 4, (pack, s, g)
        assert g["anon"] - s["anon"] < more / 40, (pack, s, g)
