"""Family member names (`workers.metrics.Metric.member`): an empty field value is refused.

"passkey_acc/len=/depth=0.50" would be stored, but no family's pattern (one or more characters per field) reads
it back, so the point would sit in the store under a name the dashboard and `lookup` never find.
"""

from __future__ import annotations

import pytest

from workers import metrics


def test_an_empty_field_value_is_refused() -> None:
    cell = metrics.PASSKEY_ACC_CELL
    with pytest.raises(ValueError, match="must be non-empty"):
        cell.member(len="", depth="0.50")
    with pytest.raises(ValueError, match="must be non-empty"):
        metrics.VAL_LOSS_POS.member(pos="")
    assert metrics.lookup("passkey_acc/len=/depth=0.50") is None  # why: nothing would read it back
    assert metrics.VAL_LOSS_POS.member(pos="0-1023") == "val_loss/pos=0-1023"
