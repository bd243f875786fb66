"""Passkey retrieval: a random numeric key hidden at a chosen depth in filler text, asked for at the
end.

Layout of one sample (exactly seq_len + 1 tokens, so it yields seq_len inputs and seq_len labels):

    INTRO  filler[:a]  NEEDLE(key)  filler[a:]  QUESTION  key

Every piece is encoded separately with the job's tokenizer (bytes for native models, the model's own
for pretrained ones), so the answer is exactly `tokenizer.encode(key)` whatever merges a BPE would
have made across piece boundaries. `depth` is the needle's relative position inside the haystack
(0 = right after the intro, 1 = just before the question). The answer tokens are the last labels;
their loss weight is `answer_weight`, every other label weighs 1. Contexts too short for this
phrasing drop the intro, then switch to a compact one ("pass key 123. " … "pass key? 123"), so
every length the spec accepts (seq_len ≥ 64 and ≥ 16 · key_digits) holds a sample.

Curriculum: `PasskeySource` may train its first steps on shorter contexts (`stages`, a list of
(steps, seq_len)). A short context gives the answer's attention fewer positions to spread over, so
the retrieval signal is stronger and each step is cheaper; the stage lengths are part of the data
spec, so the global batch still depends only on (data spec, seed, step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.data.batch import Batch, from_windows
from workers.data.tokenizer import ByteTokenizer, Tokenizer

INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and remember it. "
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "
SHORT_NEEDLE = "pass key {key}. "
SHORT_QUESTION = "pass key? "

BYTES = ByteTokenizer()


@dataclass(frozen=True)
class PasskeySample:
    tokens: torch.Tensor  # [seq_len + 1] int64
    weights: torch.Tensor  # [seq_len] float32, per label
    key: str
    needle_start: int  # token offset of the needle
    answer_start: int  # label index of the first answer token (the answer runs to the end)

    def answer_mask(self) -> torch.Tensor:
        """[seq_len] float32: 1 on the labels that are answer tokens, 0 elsewhere."""
        mask = torch.zeros(self.weights.shape, dtype=torch.float32)
        mask[self.answer_start :] = 1.0
        return mask


def make_sample(
    seq_len: int,
    key_digits: int,
    depth: float | None,
    generator: torch.Generator,
    answer_weight: float = 1.0,
    tokenizer: Tokenizer = BYTES,
) -> PasskeySample:
    """One sample; all randomness (key, and depth when None) comes from `generator`."""
    first = int(
        torch.randint(1, 10, (1,), generator=generator)
    )  # no leading zero: the key has key_digits digits
    rest = torch.randint(0, 10, (key_digits - 1,), generator=generator).tolist()
    key = str(first) + "".join(map(str, rest))
    if depth is None:
        depth = float(torch.rand((), generator=generator))
    total = seq_len + 1
    answer = tokenizer.encode(key)
    for intro_s, needle_s, question_s in (
        (INTRO, NEEDLE, QUESTION),
        ("", NEEDLE, QUESTION),  # short contexts: drop the intro first,
        (
            "",
            SHORT_NEEDLE,
            SHORT_QUESTION,
        ),  # then use the compact phrasing (fits any spec-valid length)
    ):
        intro, needle, question = (
            tokenizer.encode(x) for x in (intro_s, needle_s.format(key=key), question_s)
        )
        haystack = total - len(intro) - len(needle) - len(question) - len(answer)
        if haystack >= 0:
            break
    else:
        raise ValueError(f"seq_len {seq_len} is too short for a {key_digits}-digit passkey")
    filler = _filler(tokenizer, haystack)  # type: ignore[arg-type]  # tokenizers hash by identity
    cut = round(depth * haystack)
    ids = [*intro, *filler[:cut], *needle, *filler[cut:], *question, *answer]
    tokens = torch.tensor(ids, dtype=torch.long)
    weights = torch.ones(seq_len, dtype=torch.float32)
    answer_start = seq_len - len(answer)  # label j predicts tokens[j + 1]
    weights[answer_start:] = answer_weight
    return PasskeySample(tokens, weights, key, len(intro) + cut, answer_start)


@functools.lru_cache(maxsize=16)
def _filler(tokenizer: Tokenizer, n: int) -> tuple[int, ...]:
    """`n` tokens of repeated filler text (tokenized whole: a tokenizer may merge across sentences).

    Cached: every sample of a length shares it, and a pretrained tokenizer takes milliseconds per
    long text.
    """
    unit = tokenizer.encode(FILLER)
    reps = n // max(1, len(unit)) + 2
    ids = tokenizer.encode(FILLER * reps)
    while len(ids) < n:  # a tokenizer whose repeats merge into fewer tokens than expected
        reps *= 2
        ids = tokenizer.encode(FILLER * reps)
    return tuple(ids[:n])


def sample_generator(seed: int, *stream: int) -> torch.Generator:
    """A generator whose state depends only on (seed, *stream): e.g. (seed, step, index)."""
    g = torch.Generator()
    mixed = seed & 0xFFFFFFFFFFFF
    for s in stream:
        mixed = (mixed * 1_000_003 + s + 0x9E3779B9) % (2**61 - 1)
    g.manual_seed(mixed)
    return g


class PasskeySource:
    """Endless passkey batches: sample i of step s is drawn from its own generator (seed, s, i).

    `stages`: [(steps, seq_len), ...] trained in order before `seq_len` (the curriculum); the length
    of step s's batch is a function of s alone, so a resumed run continues exactly where it left
    off.
    """

    def __init__(
        self,
        seq_len: int,
        key_digits: int,
        depth: float | None,
        answer_weight: float,
        seed: int,
        tokenizer: Tokenizer = BYTES,
        stages: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.seq_len, self.key_digits, self.depth = seq_len, key_digits, depth
        self.answer_weight, self.seed, self.tokenizer = answer_weight, seed, tokenizer
        self.stages = tuple(stages)

    def length_at(self, step: int) -> int:
        """Context length of step `step`'s batch (0-based)."""
        end = 0
        for steps, length in self.stages:
            end += steps
            if step < end:
                return length
        return self.seq_len

    def global_batch(self, step: int, batch_size: int) -> Batch:
        length = self.length_at(step)
        samples = [
            make_sample(
                length,
                self.key_digits,
                self.depth,
                sample_generator(self.seed, step, i),
                self.answer_weight,
                self.tokenizer,
            )
            for i in range(batch_size)
        ]
        return from_windows(
            torch.stack([s.tokens for s in samples]), torch.stack([s.weights for s in samples])
        )

    def state_dict(self) -> dict:
        return {"kind": "passkey", "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"checkpoint data seed {state.get('seed')} != spec seed {self.seed}")
