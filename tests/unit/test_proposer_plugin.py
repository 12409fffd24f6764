"""A proposer defined outside outrider, registered by name through the public registry
(outrider.engine.proposers), serves `LLM(speculative={"method": name})` like a built-in one:
greedy output equals plain greedy output and its drafts are verified. The registry refuses a
taken name, a name configs cannot spell, and lists the choices for an unknown method."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from outrider import LLM, SamplingParams
from outrider.core import Request, ScheduledBatch, SeqDrafts, StepOutput
from outrider.engine.proposers import proposer_names, register_proposer, unregister_proposer
from outrider.speculative.base import Proposer
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=20)
K = 4


class OracleProposer:
    """Drafts each request's continuation from a table (prompt -> the target's greedy output):
    every draft is right, so every draft the engine verifies is accepted."""

    name = "oracle"
    on_device = False
    aux_layers: tuple[int, ...] = ()
    writes_kv = False
    topk = 1

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        out = []
        for req in requests:
            done = len(req.output_token_ids)
            full = self.continuations[tuple(req.prompt_token_ids)]
            out.append(SeqDrafts.chain(full[done : done + max_draft_tokens]))
        return out

    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def positions_needed(self, k: int) -> int:
        return 1 + k


class RepeatLastProposer(OracleProposer):
    """Drafts the request's last token k times: mostly wrong, never harmful."""

    name = "repeatlast"

    def __init__(self) -> None:
        super().__init__({})

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        return [SeqDrafts.chain([r.all_token_ids[-1]] * max_draft_tokens) for r in requests]


def build_repeat_last(config, runner, checkpoint) -> RepeatLastProposer:
    return RepeatLastProposer()


@pytest.fixture
def register():
    """register_proposer, with every name it registered unregistered after the test."""
    names: list[str] = []

    def add(name, builder) -> None:
        register_proposer(name, builder)
        names.append(name)

    yield add
    for name in names:
        unregister_proposer(name)
    assert proposer_names() == ("ngram", "eagle3")


def _llm(tiny_dir, method: str) -> LLM:  # noqa: F811
    spec = {"method": method, "controller": "fixed", "num_draft_tokens": K}
    return LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, speculative=spec)


def test_a_registered_builder_serves_by_name(tiny_dir, prompts, reference, register):  # noqa: F811
    oracle = OracleProposer({tuple(p): r for p, r in zip(prompts, reference)})
    register("oracle", lambda config, runner, checkpoint: oracle)
    llm = _llm(tiny_dir, "oracle")
    assert llm.engine.speculator.proposer is oracle and isinstance(oracle, Proposer)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_a_builder_named_by_module_serves(tiny_dir, prompts, reference, register):  # noqa: F811
    register("repeatlast", f"{__name__}:build_repeat_last")
    llm = _llm(tiny_dir, "RepeatLast")  # configs take any case, as for the built-in ones
    assert isinstance(llm.engine.speculator.proposer, RepeatLastProposer)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.speculator.stats.num_verify_steps > 0


def test_the_registry_refuses_what_it_cannot_serve(tiny_dir, register):  # noqa: F811
    register("oracle", build_repeat_last)
    with pytest.raises(ValueError, match="already registered as 'oracle'.*unregister_proposer"):
        register_proposer("oracle", build_repeat_last)
    with pytest.raises(ValueError, match="already registered as 'ngram'"):
        register_proposer("ngram", build_repeat_last)
    with pytest.raises(ValueError, match="register it as 'repeatlast'"):
        register_proposer("Repeat_Last", build_repeat_last)
    with pytest.raises(ValueError, match="'build_repeat_last' is not 'module:attribute'"):
        register_proposer("repeatlast", "build_repeat_last")
    with pytest.raises(ValueError, match="outrider's own proposers"):
        unregister_proposer("eagle3")
    with pytest.raises(ValueError, match="unknown speculative method='nosuch': use one of "
                       "ngram, eagle3, oracle, or None"):  # fmt: skip
        _llm(tiny_dir, "nosuch")
