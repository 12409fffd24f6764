"""Structured outputs on CUDA with graphs: the default model in fp32, constrained greedy output
the same token for token with n-gram and EAGLE-3 (chain and tree) as without, at one stream and
at sixteen, and every finished output valid against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from outrider import LLM, SamplingParams
from outrider.bench.datasets import HELDOUT

pytestmark = pytest.mark.gpu

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 60},
            "confidence": {"enum": ["low", "medium", "high"]},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
]

SPECS = {
    "ngram": {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
    "eagle3_chain": {"method": "eagle3", "num_draft_tokens": 4, "controller": "fixed"},
    "eagle3_tree": {
        "method": "eagle3",
        "num_draft_tokens": 8,
        "topk": 2,
        "num_steps": 4,
        "controller": "fixed",
    },  # fmt: skip
}


def _run(llm: LLM, n: int) -> list:
    convs = [
        [{"role": "user", "content": HELDOUT[i % len(HELDOUT)] + " Answer as JSON."}]
        for i in range(n)
    ]
    params = [
        SamplingParams(
            temperature=0, max_tokens=96, structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]}
        )  # fmt: skip
        for i in range(n)
    ]
    return [r.outputs[0] for r in llm.chat(convs, params)]


@pytest.mark.parametrize("name", list(SPECS))
def test_constrained_speculation_equals_constrained_plain_fp32(name, monkeypatch):
    from outrider.executor.spec_step import SpecStep

    tree_steps, run_tree = [], SpecStep.run_tree
    monkeypatch.setattr(
        SpecStep, "run_tree", lambda self, b: tree_steps.append(b) or run_tree(self, b)
    )
    plain = LLM(device="cuda", dtype="float32")
    want = {n: _run(plain, n) for n in (1, 16)}
    for outs in want.values():
        for i, o in enumerate(outs):
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMAS[i % len(SCHEMAS)])
    del plain
    llm = LLM(device="cuda", dtype="float32", speculative=SPECS[name])
    assert llm.engine.runner.graphs is not None
    for n, outs in want.items():
        got = _run(llm, n)
        assert [o.token_ids for o in got] == [o.token_ids for o in outs], (name, n)
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 0
    assert stats.num_forced_drafts > 0  # trees: where the grammar refuses the whole tree
    if name == "eagle3_tree":  # constrained greedy trees verify in the replayed tree step
        assert tree_steps, "constrained trees left the tree step"


def test_constrained_greedy_runs_ahead_with_the_same_tokens_fp32():
    """Async scheduling (on by default on CUDA): greedy constrained rows run ahead on their
    unmasked argmax, dropped where the grammar picks another; the same tokens as stepping one
    batch at a time, at one stream and at sixteen, and steps did run ahead."""
    sync = LLM(device="cuda", dtype="float32", async_scheduling=False)
    want = {n: _run(sync, n) for n in (1, 16)}
    del sync
    llm = LLM(device="cuda", dtype="float32")
    engine = llm.engine
    assert engine._async
    for n, outs in want.items():
        got = _run(llm, n)
        assert [o.token_ids for o in got] == [o.token_ids for o in outs], n
    assert engine.num_steps_run_ahead > 10
    assert engine.num_steps_run_ahead_dropped < engine.num_steps_run_ahead
    assert not engine.grammars and engine._ahead is None
