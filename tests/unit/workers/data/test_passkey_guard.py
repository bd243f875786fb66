"""The needle sits at exactly round(depth x haystack) filler tokens into the haystack.

test_data.py allows the needle two tokens of slack; here the offset is exact, measured on the decoded
text (intro, question and answer are located in it, so the haystack length is counted, not computed by
the code under test). Depths are chosen so that rounding and truncation differ for some of them.
"""

from __future__ import annotations

from workers.data.passkey import INTRO, NEEDLE, QUESTION, make_sample, sample_generator
from workers.data.tokenizer import ByteTokenizer

DEPTHS = [0.1, 0.2, 0.3, 1 / 3, 0.4, 0.6, 0.7, 0.8, 0.9]


def test_needle_offset_is_the_rounded_depth_of_the_haystack() -> None:
    seq_len, digits = 301, 4
    fractions = []
    for depth in DEPTHS:
        s = make_sample(seq_len, digits, depth, sample_generator(5, 0, 1))
        text = ByteTokenizer().decode(s.tokens)
        needle = NEEDLE.format(key=s.key)
        assert text.startswith(INTRO) and text.endswith(QUESTION + s.key)
        haystack = len(text) - len(INTRO) - len(needle) - len(QUESTION) - digits
        offset = text.index(needle) - len(INTRO)
        assert offset == round(depth * haystack), (depth, haystack, offset)
        assert s.needle_start == len(INTRO) + offset
        fractions.append(depth * haystack % 1)
    assert max(fractions) > 0.5  # some depth falls where int() would cut one token short
