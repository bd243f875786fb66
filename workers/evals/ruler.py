"""RULER-style synthetic long-context tasks, generated offline and deterministically.

Each task builds a prompt of a target length *in the model's own tokens* and the reference
strings a correct answer contains. The tasks follow RULER (Hsieh et al., 2024): needles in a
haystack with one or several keys, values and queries; variable tracking (follow a chain of
assignments); common-words extraction (the words a long list repeats most); frequent-words
extraction (the most frequent words of a Zipf-distributed coded text). Nothing is downloaded:
haystacks are a fixed filler ("noise") or sentences drawn from a built-in word list ("essay").

A sample depends only on (task, length, index, seed) and the tokenizer, so two runs, or the same
evaluation before and after an extension, ask the same questions. `solve` is a reference solver
that reads the answers back out of the prompt text: the tests use it to show every sample is
answerable from its prompt.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from workers.data.tokenizer import Tokenizer

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river garden window letter market valley summer winter island forest bridge"
)
_ADJECTIVES = (
    "quiet bright ancient swift golden hidden curious gentle silver brave crimson frozen humble "
    "lively narrow proud rapid scarlet tender vivid wicked young zealous amber bold calm"
)
WORDS, ADJECTIVES = tuple(_WORDS.split()), tuple(_ADJECTIVES.split())
NIAH_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_RE = re.compile(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.")


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the target, in tokens
    index: int
    prompt: str
    answers: list[str]
    max_new_tokens: int


def _sentences(kind: str, rng: random.Random) -> Callable[[], str]:
    """An endless haystack, one sentence at a time."""
    if kind == "noise":
        return lambda: NOISE
    return lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."


def _fit(
    tok: Tokenizer, length: int, make: Callable[[int], str], low: int = 0, high: int = 1 << 20
) -> str:
    """The longest `make(n)` (n haystack units) whose encoding fits `length` tokens: a binary
    search over n on the real tokenizer, so the prompt is as close to the target as units allow."""
    if len(tok.encode(make(low))) > length:
        raise ValueError(f"length {length} is too short for this task's question and answer")
    hi = 1
    while hi < high and len(tok.encode(make(hi))) <= length:
        hi *= 2
    lo, hi = hi // 2, min(hi, high)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode(make(mid))) <= length:
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"
        if key not in used:
            used.add(key)
            return key


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _niah(
    tok: Tokenizer,
    length: int,
    rng: random.Random,
    *,
    haystack: str,
    keys: int,
    values: int,
    queries: int,
) -> tuple[str, list[str]]:
    """`keys` needle keys (the first `queries` are asked), `values` values per asked key."""
    used: set[str] = set()
    names = [_key(rng, used) for _ in range(keys)]
    needles: list[tuple[str, str]] = []
    for i, key in enumerate(names):
        for _ in range(values if i < queries else 1):
            needles.append((key, _number(rng)))
    rng.shuffle(needles)
    asked = names[:queries]
    answers = [v for k, v in needles if k in asked]
    sentence = _sentences(haystack, random.Random(rng.random()))
    filler = [sentence() for _ in range(4096)]
    depths = sorted(rng.random() for _ in needles)
    if queries == 1 and values == 1:
        question = (
            f"What is the special magic number for {asked[0]} mentioned in the provided text?"
        )
        lead = f"The special magic number for {asked[0]} mentioned in the provided text is"
    elif queries == 1:
        question = (
            f"What are all the special magic numbers for {asked[0]} mentioned in the provided text?"
        )
        lead = f"The special magic numbers for {asked[0]} mentioned in the provided text are"
    else:
        joined = ", ".join(asked[:-1]) + f" and {asked[-1]}"
        question = (
            f"What are all the special magic numbers for {joined} mentioned in the provided text?"
        )
        lead = f"The special magic numbers for {joined} mentioned in the provided text are"

    def make(n: int) -> str:
        units = [filler[i % len(filler)] for i in range(n)]
        # deepest first, at places taken on the haystack alone: the needles keep their order
        for (key, value), depth in zip(reversed(needles), reversed(depths), strict=True):
            units.insert(round(depth * n), NEEDLE.format(key=key, value=value))
        return f"{NIAH_HEADER}{' '.join(units)}\n{question} {lead}"

    return _fit(tok, length, make), answers


def _variable_tracking(tok: Tokenizer, length: int, rng: random.Random) -> tuple[str, list[str]]:
    """A chain of 5 assignments from a number, spread over a noise haystack."""
    used: set[str] = set()

    def name() -> str:
        while True:
            v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if v not in used:
                used.add(v)
                return v

    value = str(rng.randint(10_000, 99_999))
    chain = [name() for _ in range(5)]
    lines = [f"VAR {chain[0]} = {value}."] + [
        f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, 5)
    ]
    depths = sorted(rng.random() for _ in lines)
    question = (
        f"Question: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"5 variables are assigned the value {value}, they are:"
    )

    def make(n: int) -> str:
        units = [NOISE] * n
        for line, depth in zip(reversed(lines), reversed(depths), strict=True):
            units.insert(round(depth * n), line)  # deepest first: the chain keeps its order
        context = " ".join(units)
        return (
            "Memorize and track the chain(s) of variable assignment hidden in the following "
            f"text.\n\n{context}\n{question}"
        )

    return _fit(tok, length, make), chain


def _words(rng: random.Random, n: int, used: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
        if w not in used:
            used.add(w)
            out.append(w)
    return out


def _common_words(tok: Tokenizer, length: int, rng: random.Random) -> tuple[str, list[str]]:
    """A numbered word list: 10 words appear `common` times each, every other word `rare` times."""
    used: set[str] = set()
    top = _words(rng, 10, used)
    pool = _words(rng, 4096, used)
    common, rare = 6, 2
    question = (
        "Question: What are the 10 most common words in the above list? Answer: The top 10 "
        "words that appear most often in the list are:"
    )

    def make(n: int) -> str:
        words = top * common + [w for w in pool[:n] for _ in range(rare)]
        random.Random(n).shuffle(words)
        listed = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return (
            "Below is a numbered list of words. In these words, some appear more often than "
            f"others. Memorize the ones that appear most often.\n{listed}\n{question}"
        )

    return _fit(tok, length, make, high=len(pool)), top


def _frequent_words(tok: Tokenizer, length: int, rng: random.Random) -> tuple[str, list[str]]:
    """A coded text whose word counts fall off as 1/rank (Zipf); the three most frequent words
    are strictly more frequent than every other."""
    used: set[str] = set()
    vocab = _words(rng, 64, used)
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
        "three most frequently appeared words in the above coded text? Answer: According to the "
        "coded text above, the three most frequently appeared words are:"
    )

    def make(n: int) -> str:
        # word r (0-based) appears (n + 8) // (r + 1) times (rare words not at all in short
        # texts); the top three are kept strictly above everything else
        counts = [(n + 8) // (r + 1) for r in range(len(vocab))]
        counts[3:] = [min(c, counts[2] - 1) for c in counts[3:]]
        words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(n).shuffle(words)
        return (
            "Read the following coded text and track the frequency of each coded word. Find "
            f"the three most frequently appeared coded words. .... {' .... '.join(words)}\n"
            f"{question}"
        )

    return _fit(tok, length, make), vocab[:3]


TASKS: dict[str, tuple[Callable[[Tokenizer, int, random.Random], tuple[str, list[str]]], int]] = {
    "niah_single_noise": (
        lambda t, n, r: _niah(t, n, r, haystack="noise", keys=1, values=1, queries=1),
        24,
    ),
    "niah_single_essay": (
        lambda t, n, r: _niah(t, n, r, haystack="essay", keys=1, values=1, queries=1),
        24,
    ),
    "niah_multikey": (
        lambda t, n, r: _niah(t, n, r, haystack="essay", keys=4, values=1, queries=1),
        24,
    ),
    "niah_multivalue": (
        lambda t, n, r: _niah(t, n, r, haystack="essay", keys=1, values=4, queries=1),
        64,
    ),
    "niah_multiquery": (
        lambda t, n, r: _niah(t, n, r, haystack="essay", keys=4, values=1, queries=4),
        64,
    ),
    "vt": (_variable_tracking, 32),
    "cwe": (_common_words, 96),
    "fwe": (_frequent_words, 40),
}


def make_sample(tok: Tokenizer, task: str, length: int, index: int, seed: int = 0) -> Sample:
    """Sample `index` of `task` at `length` tokens (deterministic in all four and the tokenizer)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    build, max_new = TASKS[task]
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    prompt, answers = build(tok, length, rng)
    return Sample(task, length, index, prompt, answers, max_new)


def solve(task: str, prompt: str) -> list[str]:
    """A reference solver: the answers, read back out of the prompt text alone."""
    context, question = prompt.rsplit("\n", 1)
    if task.startswith("niah"):
        needles = NEEDLE_RE.findall(context)
        asked = re.findall(r"magic numbers? for (.+?) mentioned", question)[0]
        keys = [k.strip() for k in re.split(r", | and ", asked)]
        return [v for k, v in needles if k in keys]
    if task == "vt":
        found = re.search(r"assigned the value (\d+) in", question)
        value = found.group(1) if found else ""
        names: list[str] = []
        for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", context):
            if source == value or source.removeprefix("VAR ") in names:
                names.append(name)
        return names
    if task == "cwe":
        words = re.findall(r"\d+\. (\w+)", context)
        return [w for w, _ in Counter(words).most_common(10)]
    if task == "fwe":
        words = context.split("coded words. .... ", 1)[1].split(" .... ")
        return [w for w, _ in Counter(words).most_common(3)]
    raise ValueError(f"unknown task {task!r}")
