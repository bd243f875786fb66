"""Real corpora: prepare throughput, and what a corpus costs a job's start and memory.

    python -m bench.data [--small-mb 1] [--large-mb 300] [--throughput-mb 30] [--work /tmp/ringtrain-bench-data]

1. Prepare throughput: a jsonl corpus of `--throughput-mb` through `python -m workers.data.prepare`'s code on a
   local Ray of 1 and then 2 CPUs, with a small byte-level BPE trained here (a real tokenizer's cost per byte);
   MB/s of source and the 2-core / 1-core ratio.
2. Corpus size: corpora of `--small-mb` and `--large-mb` (generated here), prepared with the bytes tokenizer,
   then one training step of a small native model (`torchrun --nproc-per-node 1 -m workers.train --steps 1`) on
   `data.kind: tokens` and, for reference, `data.kind: text` (which tokenizes the whole corpus into memory at
   every start): time from launch to the end of step 1 and the rank's peak RSS. Ratios large / small.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "not",
    "ring",
    "attention",
    "sequence",
    "long",
    "context",
    "model",
    "token",
    "layer",
    "memory",
    "shard",
    "rank",
    "step",
    "loss",
    "batch",
    "corpus",
]


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """A jsonl of documents of 200-20000 words drawn from a small vocabulary, about `megabytes` large."""
    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    with path.open("w") as f:
        written = 0
        while written < target:
            n = rng.randint(200, 20000)
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=n))}) + "\n"
            f.write(line)
            written += len(line)
    return path


def write_bpe(out: Path, sample: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with sample.open() as f:
        tok.train_from_iterator(
            [json.loads(line)["text"] for _, line in zip(range(200), f, strict=False)], trainer
        )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def prepare_in_subprocess(src: Path, out: Path, tokenizer: str, cpus: int) -> float:
    """Seconds for a prepare on a fresh local Ray of `cpus` CPUs (Ray's start excluded: it is timed inside).

    Chunks of 1/16 of the corpus (at least 1 MB): enough rows that 2 CPUs are never left with one big one."""
    chunk = max(1 << 20, src.stat().st_size // 16)
    code = (
        "import json, sys, time, ray\n"
        "from workers.data.prepare import prepare\n"
        f"ray.init(num_cpus={cpus}, include_dashboard=False, log_to_driver=False)\n"
        "t = time.perf_counter()\n"
        f"prepare({str(src)!r}, {str(out)!r}, tokenizer={tokenizer!r}, chunk_bytes={chunk})\n"
        "print(json.dumps({'seconds': time.perf_counter() - t}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT
    )
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def first_step(spec: dict, work: Path) -> tuple[float, int]:
    """(seconds from launch to the end of step 1, peak RSS bytes of the rank) of a one-rank torchrun."""
    import yaml

    spec_path = work / f"{spec['name']}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    metrics = work / f"{spec['name']}.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "workers.train",
        str(spec_path), "--steps", "1", "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # a fresh wrapper per run: RUSAGE_CHILDREN's maxrss is the largest descendant it waited for (the rank)
    wrapper = [sys.executable, "-c", PEAK_WRAPPER, *cmd]
    t = time.perf_counter()
    done = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    seconds = time.perf_counter() - t
    return seconds, int(done.stdout.strip().splitlines()[-1]) * 1024


PEAK_WRAPPER = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def spec_for(name: str, data: dict) -> dict:
    return {
        "name": name,
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "data": data,
        "parallel": {"ring_size": 1},
        "train": {"steps": 1, "batch_size": 1},
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small-mb", type=float, default=1.0)
    ap.add_argument("--large-mb", type=float, default=300.0)
    ap.add_argument("--throughput-mb", type=float, default=30.0)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--skip-text", action="store_true", help="do not run the kind: text reference")
    ap.add_argument(
        "--throughput-only", action="store_true", help="only the prepare throughput table"
    )
    ap.add_argument("--work", default="/tmp/ringtrain-bench-data")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    print(f"## prepare throughput ({args.throughput_mb:g} MB jsonl, byte-level BPE of 2000 ids)\n")
    src = write_corpus(work / "throughput.jsonl", args.throughput_mb, seed=1)
    bpe = write_bpe(work / "bpe", src)
    size_mb = src.stat().st_size / 1e6
    rates = {}
    for cpus in (1, 2):
        out = work / f"prepared-bpe-{cpus}"
        seconds = prepare_in_subprocess(src, out, str(bpe), cpus)
        rates[cpus] = size_mb / seconds
        shutil.rmtree(out)
    print("| Ray CPUs | MB/s | vs 1 CPU |\n|---|---|---|")
    for cpus, rate in rates.items():
        print(f"| {cpus} | {rate:.2f} | {rate / rates[1]:.2f}x |")

    if args.throughput_only:
        return
    print(f"\n## corpus size: one step of a native model (seq {args.seq_len}, bytes), {args.small_mb:g} MB vs "
          f"{args.large_mb:g} MB\n")  # fmt: skip
    rows = []
    corpora = {}
    for label, mb in (("small", args.small_mb), ("large", args.large_mb)):
        corpus = write_corpus(work / f"{label}.jsonl", mb, seed=2)
        t = time.perf_counter()
        prepare_in_subprocess(corpus, work / f"{label}-ds", "bytes", 2)
        corpora[label] = (corpus, time.perf_counter() - t)
    kinds = ["tokens"] + ([] if args.skip_text else ["text"])
    for kind in kinds:
        for label in ("small", "large"):
            corpus, _ = corpora[label]
            data = (
                {"kind": "tokens", "path": str(work / f"{label}-ds"), "seq_len": args.seq_len}
                if kind == "tokens"
                else {"kind": "text", "path": str(corpus), "seq_len": args.seq_len}
            )
            seconds, peak = first_step(spec_for(f"{kind}-{label}", data), work)
            rows.append((kind, label, corpus.stat().st_size / 1e6, seconds, peak))
    print(
        "| data.kind | corpus MB | launch -> step 1 (s) | rank peak RSS (GB) |\n|---|---|---|---|"
    )
    for kind, _, mb, seconds, peak in rows:
        print(f"| {kind} | {mb:.0f} | {seconds:.1f} | {peak / 1e9:.2f} |")
    for kind in kinds:
        small = next(r for r in rows if r[0] == kind and r[1] == "small")
        large = next(r for r in rows if r[0] == kind and r[1] == "large")
        print(
            f"\n{kind}: large/small start time {large[3] / small[3]:.2f}x, peak RSS {large[4] / small[4]:.2f}x"
        )
    for label, (_, seconds) in corpora.items():
        print(f"prepare ({label}, bytes, 2 CPUs, Ray start included): {seconds:.1f} s")


if __name__ == "__main__":
    main()
