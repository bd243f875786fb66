"""Long-context evaluation: RULER-style synthetic tasks (`ruler`), their scores and effective
length (`scoring`), and greedy generation over a ring (`generate`: ring prefill, pass-Q decoding).
"""
