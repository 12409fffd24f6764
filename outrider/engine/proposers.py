"""Proposers by name, imported lazily: a new drafter adds a file and a registry entry (a line in
`_PROPOSERS` for outrider's own, `register_proposer` for one that lives elsewhere). It lives in
the engine because a drafter that is a network is run by the executor (executor/drafter.py),
and the speculative algorithms import nothing from the executor. Importing it imports no torch:
the CLI lists the names for `--spec`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from outrider.config import SpecConfig
from outrider.registry import Registry

if TYPE_CHECKING:
    from outrider.executor.model_runner import ModelRunner
    from outrider.loaders.checkpoint import Checkpoint
    from outrider.speculative.base import Proposer

# builder(config, runner, checkpoint) -> Proposer; runner and checkpoint are the target's (None
# where no engine built them), for drafters that are networks.
ProposerBuilder = Callable[[SpecConfig, "ModelRunner | None", "Checkpoint | None"], "Proposer"]

# outrider's own, name -> "module:builder", then those register_proposer adds.
_PROPOSERS: Registry[ProposerBuilder] = Registry(
    "proposer",
    {
        "ngram": "outrider.speculative.ngram:build_ngram_proposer",
        "eagle3": "outrider.executor.drafter:build_eagle3_drafter",
    },
    remover="unregister_proposer",
)


def register_proposer(name: str, builder: str | ProposerBuilder) -> None:
    """Serve `speculative={"method": name}` with `builder`: a callable
    builder(config: SpecConfig, runner, checkpoint) -> Proposer (speculative/base.py), or
    "module:function" naming one, imported when an engine first asks for `name`.

    `name` is spelled as a config spells methods (lower case, no '-' or '_'); a name already
    registered is refused (unregister_proposer frees one this function registered). Engines
    build proposers on rank 0 alone, so registering in the process that builds the engine is
    enough at any tensor-parallel size."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"proposer name {name!r}: give a non-empty string, e.g. 'lookahead'")
    try:
        spelled = SpecConfig.normalize({"method": name})["method"]
    except ValueError as e:
        raise ValueError(f"cannot register proposer {name!r}: {e}") from None
    if spelled != name:
        raise ValueError(
            f"cannot register proposer {name!r}: configs spell methods in lower case without "
            f"'-' or '_'; register it as {spelled!r}"
        )
    if not isinstance(builder, str) and not callable(builder):
        raise TypeError(
            f"proposer builder for {name!r} is a {type(builder).__name__}: give a callable "
            "builder(config, runner, checkpoint) -> Proposer, or 'module:function'"
        )
    _PROPOSERS.register(name, builder)


def unregister_proposer(name: str) -> None:
    """Forget a name `register_proposer` registered; outrider's own stay."""
    _PROPOSERS.unregister(name)


def proposer_names() -> tuple[str, ...]:
    """Every registered name: outrider's own first, then the others in registration order."""
    return _PROPOSERS.names()


def check_method(method: str | None) -> None:
    """Refuse a speculative method no proposer is registered under (None decodes plainly):
    engines call it before loading a model."""
    if method is not None and method not in _PROPOSERS:
        raise ValueError(
            f"unknown speculative method={method!r}: use one of {', '.join(_PROPOSERS.names())}, or "
            "None to decode without speculation (a proposer of your own serves once "
            "outrider.engine.proposers.register_proposer names it)"
        )


def build_proposer(
    config: SpecConfig, runner: ModelRunner | None = None, checkpoint: Checkpoint | None = None
) -> Proposer | None:
    """The proposer config.method names (None: no speculation). runner, checkpoint: the
    target's ModelRunner and checkpoint, for drafters that are networks (EAGLE-3)."""
    if config.method is None:
        return None
    check_method(config.method)
    return _PROPOSERS.get(config.method)(config, runner, checkpoint)
