"""Next-fit packing, the rule of `data.pack: documents`: pieces (documents cut into seq_len pieces)
are visited in order and a piece that no longer fits closes the sequence, whose tail is padding.

`TokensSource` (workers/data/tokens.py) applies this rule while it scans a prepared dataset; this
function is the same rule on piece lengths alone, for synthetic packings (`bench/packing.py`,
tests).
"""

from __future__ import annotations


def pack_sequences(lengths: list[int], order: list[int], seq_len: int) -> list[list[int]]:
    """Next-fit packing of pieces (all <= seq_len) visited in `order`: lists of piece indices per
    sequence."""
    packs: list[list[int]] = []
    used = seq_len  # forces a new sequence for the first piece
    for i in order:
        if used + lengths[i] > seq_len:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += lengths[i]
    return packs
