"""A tiny context extension, end to end on CPU: the effective length before and after.

    python -m bench.extension [--rope linear|theta|none] [--length 128] [--steps-short 400]
        [--steps-long 150] [--seed 0] [--threads 1] [--json FILE]

A tiny Llama checkpoint with a byte-level tokenizer (written here, nothing downloaded; hidden 64,
2 layers, 4 heads, 2 KV heads, `max_position_embeddings` = L) trains as one job with two `stages`
through the project's own training path (`run_training`, one process):

- stage *short*: passkey retrieval (a one-digit key at a random depth in filler text, answer
  weight 10) at L tokens;
- stage *extend*: the same task at 4L tokens, starting from *short*'s last checkpoint, with
  linear RoPE scaling (position interpolation, factor 4; `--rope theta`: a larger `rope_theta`;
  `--rope none`: RoPE unchanged).

The job's own passkey evaluation (exact match of the key by teacher forcing, 8 keys per cell at
depths 0.1, 0.5 and 0.9) runs at L, 2L and 4L after each stage. A length's score is the mean over
its depths; the effective length is RULER's rule (`workers.evals.scoring.effective_length`: the
longest length whose score is at least 0.856). After the job, the exported model is asked the
same keys by greedy decoding, through transformers' `generate` and through `ringtrain eval`'s
pass-Q decoder: both must give the job's scores.

Why passkey and not the RULER tasks of `ringtrain eval`: their needles are 7-digit numbers, and
copying one needs an induction circuit that a model this small does not form in minutes of CPU
(BENCHMARKS.md, "A tiny extension": 0 of the digits in 400 steps); a one-digit key is the
retrieval a 2-layer model learns in a few hundred steps, so its score can move.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workers.config import JobSpec
from workers.evals.scoring import THRESHOLD, effective_length
from workers.protocol import MetricPoint

DEPTHS = [0.1, 0.5, 0.9]
ROPE: dict[str, dict[str, Any]] = {  # stage *extend*'s model override
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},  # position interpolation
    # a larger base (NTK-aware for 4x: 10000 * 4 ** (16 / 14) with head_dim 16)
    "theta": {"rope_theta": 50000.0},
    "none": {},  # the same RoPE: what training at 4L alone does
}


def write_model(out: Path, length: int, seed: int = 0) -> Path:
    """A freshly initialised tiny Llama whose pretraining context is `length`, with byte tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.data.tokenizer import save_byte_tokenizer

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=length,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    save_byte_tokenizer(out)
    return out


def job_spec(model_dir: Path, args: argparse.Namespace) -> JobSpec:
    n = args.length
    return JobSpec.model_validate(
        {
            "name": "tiny-extension",
            "model": {"kind": "hf", "path": str(model_dir)},
            "data": {"kind": "passkey", "seq_len": n, "key_digits": 1, "answer_weight": 10.0},
            "parallel": {"ring_size": 1},
            "train": {
                "batch_size": 16,
                "lr": args.lr,
                "warmup_steps": 10,
                "min_lr_ratio": 1.0,
                "seed": args.seed,
            },
            "checkpoint": {"every_steps": args.steps_short, "keep": 2},
            "eval": {
                "suites": ["passkey"],
                "every_steps": args.steps_short,
                "context_lengths": [n, 2 * n, 4 * n],
                "depths": DEPTHS,
                "samples": args.samples,
            },
            "stages": [
                {"name": "short", "steps": args.steps_short},
                {
                    "name": "extend",
                    "steps": args.steps_long,
                    "data": {"seq_len": 4 * n},
                    "model": ROPE[args.rope],
                    "train": {"lr": args.lr_long, "warmup_steps": 5},
                },
            ],
        }
    )


def by_length(points: list[MetricPoint], step: int, lengths: list[int]) -> dict[str, float]:
    """Each length's passkey exact match at `step`, the mean over its depths."""
    cells = {
        p.name: p.value for p in points if p.step == step and p.name.startswith("passkey_acc/")
    }
    out = {}
    for n in lengths:
        got = [v for k, v in cells.items() if f"len={n}/" in k]
        if len(got) != len(DEPTHS):
            raise RuntimeError(f"step {step}: {len(got)} passkey cells at length {n}: {cells}")
        out[str(n)] = sum(got) / len(got)
    return out


@torch.no_grad()
def decoded(model_dir: Path, spec: JobSpec, lengths: list[int]) -> dict[str, dict[str, float]]:
    """The exported model asked the job's own eval keys (same generators), answered by greedy
    decoding in two harnesses: transformers' `generate`, and `ringtrain eval`'s pass-Q decoder
    (`workers.evals.generate.greedy_generate`, one rank). Each length's exact match, the mean over
    depths; both must equal the job's teacher-forced grid (the same rule, other code)."""
    from transformers import AutoModelForCausalLM

    from workers.data import make_sample, sample_generator
    from workers.data.tokenizer import load_tokenizer
    from workers.evals.generate import greedy_generate
    from workers.models import load_pretrained
    from workers.training.evals import EVAL_SALT

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ring = load_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    out: dict[str, dict[str, float]] = {"transformers": {}, "ringtrain_eval": {}}
    for n in lengths:
        hits: dict[str, list[bool]] = {k: [] for k in out}
        for depth in DEPTHS:
            for i in range(spec.eval.samples):
                g = sample_generator(spec.train.seed ^ EVAL_SALT, n, round(depth * 1e4), i)
                s = make_sample(n, spec.data.key_digits, depth, g, tokenizer=tok)
                prompt = s.tokens[: s.answer_start + 1][None]
                new = len(s.tokens) - prompt.shape[1]
                ids = hf.generate(
                    prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
                hits["transformers"].append(tok.decode(ids[0, prompt.shape[1] :]) == s.key)
                ids = greedy_generate(ring, prompt[0].tolist(), new)
                hits["ringtrain_eval"].append(tok.decode(ids) == s.key)
        for k, v in hits.items():
            out[k][str(n)] = sum(v) / len(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=128, help="stage 1's length L (evals: L, 2L, 4L)")
    ap.add_argument("--steps-short", type=int, default=400)
    ap.add_argument("--steps-long", type=int, default=150)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--lr-long", type=float, default=2e-3)
    ap.add_argument("--rope", choices=list(ROPE), default="linear", help="stage extend's RoPE")
    ap.add_argument("--samples", type=int, default=8, help="keys per (length, depth) cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workers.training.trainer import run_training

    lengths = [args.length, 2 * args.length, 4 * args.length]
    points: list[MetricPoint] = []

    def emit(p: MetricPoint) -> None:
        points.append(p)
        if p.rank is None and (
            (p.name == "loss" and p.step % 50 == 0) or p.name == "passkey_acc"
        ):  # progress, on stderr
            print(f"[extension] step {p.step} {p.name} {p.value:.3f}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model", args.length, args.seed)
        spec = job_spec(model_dir, args)
        ckpt = Path(tmp) / "ckpt"
        t0 = time.perf_counter()
        run_training(spec, checkpoint_dir=ckpt, emit=emit, max_steps=args.steps_short)
        t1 = time.perf_counter()
        result = run_training(spec, checkpoint_dir=ckpt, emit=emit)
        t2 = time.perf_counter()
        exported = json.loads((ckpt / "model" / "config.json").read_text())
        t3 = time.perf_counter()
        final = spec.stage_plan()[-1].spec
        checks = decoded(ckpt / "model", final, lengths)
        t4 = time.perf_counter()
    a, b = args.steps_short, args.steps_short + args.steps_long
    assert result.final_step == b, result
    train_s = {
        stage: sum(
            p.value
            for p in points
            if p.name == "step_time_s" and p.rank in (None, 0) and lo < p.step <= hi
        )
        for stage, (lo, hi) in {"short": (0, a), "extend": (a, b)}.items()
    }
    before, after = by_length(points, a, lengths), by_length(points, b, lengths)
    loss = {p.step: p.value for p in points if p.name == "loss" and p.rank is None}
    report: dict[str, Any] = {
        "lengths": lengths,
        "before": before,
        "after": after,
        "after_transformers_generate": checks["transformers"],
        "after_ringtrain_eval_decoding": checks["ringtrain_eval"],
        "effective_length": {
            "before": effective_length(before, THRESHOLD),
            "after": effective_length(after, THRESHOLD),
        },
        "threshold": THRESHOLD,
        "loss": {"end_short": loss.get(a), "start_extend": loss.get(a + 1), "end": loss.get(b)},
        "seconds": {
            "short_train": round(train_s["short"], 1),
            "short_total": round(t1 - t0, 1),
            "extend_train": round(train_s["extend"], 1),
            "extend_total": round(t2 - t1, 1),
            "decoding_checks": round(t4 - t3, 1),
        },
        "exported_rope": exported.get("rope_parameters", exported.get("rope_scaling")),
    }
    print(
        f"tiny llama (hidden 64, 2 layers, byte tokens), passkey 1 digit; stage short: "
        f"{a} steps at {args.length}; stage extend: {args.steps_long} steps at {4 * args.length}, "
        f"RoPE {args.rope} {ROPE[args.rope]}; {args.samples} keys x {len(DEPTHS)} depths per length"
    )
    print(
        f"{'length':>7} {'before':>7} {'after':>7} {'after, transformers generate':>29} "
        f"{'after, pass-Q decoding':>23}"
    )
    for n in lengths:
        k = str(n)
        print(
            f"{n:>7} {before[k]:>7.2f} {after[k]:>7.2f} {checks['transformers'][k]:>29.2f} "
            f"{checks['ringtrain_eval'][k]:>23.2f}"
        )
    eff = report["effective_length"]
    print(f"effective length (threshold {THRESHOLD}): before {eff['before']}, after {eff['after']}")
    print(f"loss: {report['loss']}")
    print(f"seconds: {report['seconds']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
