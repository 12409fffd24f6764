"""Proposers by name, imported lazily: a new drafter adds a file and a line here."""

from __future__ import annotations

from outrider.config import SpecConfig
from outrider.spec.base import Proposer


def build_proposer(config: SpecConfig) -> Proposer | None:
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
    raise ValueError(f"unknown speculative method {config.method!r}")
