"""Pretrained-architecture benchmark: a Qwen2-0.5B-shaped model (random weights) on rings of 1, 2 and 4.

    python -m bench.pretrained [--seq 4096] [--layers 2] [--vocab 32000] [--budget-mib 1024]

The model is transformers' Qwen2 (hidden 896, 14 query / 2 KV heads of 64, SwiGLU 4864, q/k/v biases,
tied head) behind ringtrain's ring attention, with fewer layers and a smaller vocabulary than the real
0.5B so it runs on a CPU machine (both shown in the header). Each ring of W gloo processes (one thread
each) runs forward + backward of a token-mean loss on the *same* global sequence. Columns:
- cpu s/step   = CPU time of the slowest rank per step (the wall time with a core per rank);
- tok/s        = global tokens / cpu s/step;
- efficiency   = (1-process cpu s/step) / (W × ring cpu s/step), measured in the same run;
- act MiB/rank = bytes autograd saves for backward on a rank (distinct storages, counted with
                 saved_tensors_hooks: exact, not an RSS reading) — what grows with the sequence;
- max seq      = longest global sequence whose saved activations fit --budget-mib per rank (linear in the
                 local length: fitted over seq/2 and seq); ratio = max seq / (W × 1-process max seq).
Weights, gradients and optimizer state (the same on every rank until FSDP shards them) are not counted.
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.support.dist import run_distributed

RINGS = (1, 2, 4)
MIB = 1 << 20
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen, self.bytes = params, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t


def _worker(rank: int, world: int, layers: int, vocab: int, seqs: list[int], reps: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.attention import shard_positions, shard_sequence
    from workers.models import PretrainedLM, SequenceParallel

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", num_hidden_layers=layers, vocab_size=vocab, **QWEN2_05B)
    model = PretrainedLM(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    model.set_sequence_parallel(SequenceParallel(None, "zigzag") if world > 1 else None)
    out = {}
    for seq in seqs:
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
        inputs, labels = (shard_sequence(t, 1, "zigzag") for t in (tokens[:, :-1], tokens[:, 1:]))
        positions = shard_positions(seq, "zigzag", rank, world)
        cpu, saved = [], SavedBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        for rep in range(reps + 1):  # the first is a warm-up (and counts the saved activations)
            model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            with torch.autograd.graph.saved_tensors_hooks(
                saved.pack if rep == 0 else lambda t: t, lambda t: t
            ):
                logits = model(inputs, positions)
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), reduction="sum"
                )
            (loss / seq).backward()
            del logits, loss
            if rep:
                cpu.append(time.process_time() - t0)
        out[seq] = (min(cpu), saved.bytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--budget-mib", type=float, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    seqs = [args.seq // 2, args.seq]
    print(
        f"Qwen2-0.5B-shaped: hidden 896, heads 14/2 × 64, ffn 4864, tied head; {args.layers} layers (of 24), "
        f"vocab {args.vocab} (of 151936); fp32, CPU, zigzag; global seq {args.seq}; budget {args.budget_mib:.0f} MiB"
    )
    rows = {}
    for world in RINGS:
        res = run_distributed(
            _worker, world, args.layers, args.vocab, seqs, args.reps, timeout=1800
        )
        cpu = {s: max(r[s][0] for r in res) for s in seqs}
        act = {s: max(r[s][1] for r in res) / MIB for s in seqs}
        slope = (act[seqs[1]] - act[seqs[0]]) / (seqs[1] - seqs[0])  # MiB per global token
        intercept = act[seqs[1]] - slope * seqs[1]
        quantum = 2 * world
        max_seq = (
            int((args.budget_mib - intercept) / slope) // quantum * quantum if slope > 0 else 0
        )
        rows[world] = (cpu[args.seq], act[args.seq], max_seq)
    cpu1, _, max1 = rows[1]
    head = ("ring", "cpu s/step", "tok/s", "efficiency", "act MiB/rank", "max seq", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (4, 10, 8, 10, 12, 8, 6), strict=True)))
    for world, (cpu, act, max_seq) in rows.items():
        eff = cpu1 / (world * cpu)
        ratio = max_seq / (world * max1) if max1 else float("nan")
        print(
            f"{world:>4} {cpu:>10.3f} {args.seq / cpu:>8.0f} {eff:>10.2f} {act:>12.0f} {max_seq:>8} {ratio:>6.2f}"
        )


if __name__ == "__main__":
    main()
