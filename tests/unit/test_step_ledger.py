"""The engine's step ledger (engine/step_ledger.py): totals by kind, in a fixed order, and an
unknown kind refused."""

from __future__ import annotations

import pytest

from outrider.engine.step_ledger import StepLedger


def test_ledger_sums_each_kind_and_lists_them_in_order():
    ledger = StepLedger()
    ledger.add("verify", 0.5, 6, 2)
    ledger.add("decode_ahead", 0.25, 4, 4)
    ledger.add("verify", 0.25, 3, 2)
    assert ledger.snapshot() == (("decode_ahead", 1, 0.25, 4, 4), ("verify", 2, 0.75, 9, 4))


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="'decoded'"):
        StepLedger().add("decoded", 0.1, 1, 1)
