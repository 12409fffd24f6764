"""Proposers by name, imported lazily: a new drafter adds a file and a line here."""

from __future__ import annotations

from outrider.config import SpecConfig
from outrider.spec.base import Proposer


def build_proposer(config: SpecConfig, runner=None, checkpoint=None) -> Proposer | None:
    """runner, checkpoint: the target's ModelRunner and checkpoint, for drafters that are
    networks (EAGLE-3)."""
    if config.method is None:
        return None
    if config.method == "ngram":
        from outrider.spec.ngram import NgramConfig, NgramProposer

        return NgramProposer(
            NgramConfig(
                min_n=config.ngram_min_n,
                max_n=config.ngram_max_n,
                num_draft_tokens=config.num_draft_tokens,
            )
        )
    if config.method == "eagle3":
        from outrider.spec.eagle3 import build_eagle3_proposer

        return build_eagle3_proposer(config, runner, checkpoint)
    raise ValueError(f"unknown speculative method {config.method!r}")
