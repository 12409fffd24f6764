"""Held-out prompts stay out of the drafter training seed set."""

from outrider.bench.datasets import HELDOUT
from outrider.train.seed_prompts import SEED_PROMPTS


def test_heldout_prompts_are_not_training_prompts():
    seen = {p.strip().lower() for p in SEED_PROMPTS}
    assert len(HELDOUT) >= 16
    assert not [p for p in HELDOUT if p.strip().lower() in seen]
