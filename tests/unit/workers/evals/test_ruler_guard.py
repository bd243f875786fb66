"""RULER task construction guards (workers/evals/ruler.py), checked on the prompt text itself
rather than through the module's own solver: the variable-tracking chain is a chain, and the three
frequent words of `fwe` are strictly more frequent than every other word."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from workers.data.tokenizer import ByteTokenizer
from workers.evals.ruler import make_sample


@pytest.mark.parametrize("index", range(3))
def test_variable_tracking_is_one_chain_in_text_order(index: int) -> None:
    s = make_sample(ByteTokenizer(), "vt", 1024, index, seed=1)
    lines = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", s.prompt)
    assert len(lines) == 5
    value = re.search(r"assigned the value (\d+) in", s.prompt).group(1)  # type: ignore[union-attr]
    assert lines[0] == (s.answers[0], value)
    for i in range(1, 5):  # each line copies the variable assigned on the line before it
        assert lines[i] == (s.answers[i], f"VAR {s.answers[i - 1]}")
    assert len(set(s.answers)) == 5


@pytest.mark.parametrize("length", [1024, 2048])
def test_frequent_words_top_three_are_strictly_the_most_frequent(length: int) -> None:
    s = make_sample(ByteTokenizer(), "fwe", length, 0, seed=2)
    text = s.prompt.split("coded words. .... ", 1)[1].rsplit("\n", 1)[0]
    counts = Counter(text.split(" .... "))
    top = [counts[w] for w in s.answers]
    rest = [c for w, c in counts.items() if w not in s.answers]
    assert len(s.answers) == 3 and min(top) > max(rest), (top, sorted(rest)[-3:])
    assert top == sorted(top, reverse=True)
