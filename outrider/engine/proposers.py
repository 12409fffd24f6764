"""Proposers by name, imported lazily: a new drafter adds a file and a line here. It lives in
the engine because a drafter that is a network is run by the executor (executor/drafter.py),
and the speculative algorithms import nothing from the executor."""

from __future__ import annotations

import importlib

from outrider.config import SpecConfig
from outrider.speculative.base import Proposer

# name -> "module:builder"; builder(config: SpecConfig, runner, checkpoint) -> Proposer
_PROPOSERS = {
    "ngram": "outrider.speculative.ngram:build_ngram_proposer",
    "eagle3": "outrider.executor.drafter:build_eagle3_drafter",
}


def build_proposer(config: SpecConfig, runner=None, checkpoint=None) -> Proposer | None:
    """runner, checkpoint: the target's ModelRunner and checkpoint, for drafters that are
    networks (EAGLE-3)."""
    if config.method is None:
        return None
    if config.method not in _PROPOSERS:
        raise ValueError(
            f"unknown speculative method {config.method!r}: use one of {sorted(_PROPOSERS)}"
        )
    module, name = _PROPOSERS[config.method].split(":")
    return getattr(importlib.import_module(module), name)(config, runner, checkpoint)
