"""Prompts that arrive while other requests speculate: a prefill step's prompt chunks run first
as a plain forward, its first tokens out at once, then its decoding requests as the speculative
step (Speculator.split).
Output stays plain decoding's token for token (fp32 greedy) for n-gram, EAGLE-3 chains and
trees, with whole and chunked prompts and with constraints, and no KV block leaks."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.engine.speculation import Speculator
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_eagle3 import eagle_llm
from tests.unit.test_structured import TINY_SPECS, tiny_json_dir  # noqa: F401 (fixture)

METHODS = ["ngram", "eagle3_chain", "eagle3_tree"]


def _llm(model_dir, method: str, **options) -> LLM:
    """Two requests run at once, so later prompts are prefilled beside speculating ones."""
    options = {"max_num_seqs": 2, **options}
    if method == "eagle3_chain":
        return eagle_llm(model_dir, **options)
    if method == "eagle3_tree":
        return eagle_llm(model_dir, topk=2, num_steps=3, **options)
    return LLM(
        str(model_dir[0]), dtype="float32", device="cpu", num_blocks=256,
        speculative={"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
        **options,
    )  # fmt: skip


@pytest.fixture
def split_steps(monkeypatch):
    """The prefill steps split into prompt chunks and decoding rows (Speculator.split): how
    many of each."""
    seen: list[tuple[int, int]] = []
    split = Speculator.split

    def watch(self, batch):
        chunks, decodes = split(self, batch)
        seen.append((len(chunks.seqs), len(decodes.seqs)))
        return chunks, decodes

    monkeypatch.setattr(Speculator, "split", watch)
    return seen


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("method", METHODS)
def test_prompts_prefilled_beside_a_speculative_step_keep_plain_output(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    split_steps,
    method,
    chunk,
):
    # Different lengths: requests finish at different steps, and the next prompt comes in
    # while the other one is decoding.
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i) for i in range(len(prompts))]
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    plain = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = _llm(tiny_dir, method, **options)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert any(p and d for p, d in split_steps), split_steps  # prompts beside decodes
    assert llm.engine.speculator.stats.num_verify_steps > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_constrained_prompts_prefilled_beside_a_speculative_step(
    tiny_json_dir,  # noqa: F811
    prompts,  # noqa: F811
    split_steps,
    method,
):
    """A constrained greedy prompt's first token is picked from its top logits in the plain
    forward beside the speculative step (its row renumbered in the step's output)."""
    params = [
        SamplingParams(
            temperature=0, max_tokens=10 + 4 * i, structured_outputs=TINY_SPECS[i % len(TINY_SPECS)]
        )
        for i in range(len(prompts))
    ]
    plain = LLM(str(tiny_json_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in _llm(tiny_json_dir, method).generate(prompts, params)]
    assert got == want
    assert any(p and d for p, d in split_steps), split_steps


@pytest.mark.parametrize("method", ["eagle3_chain", "eagle3_tree"])  # (n-gram: while it drafts)
def test_a_prompts_first_token_leaves_before_the_speculative_step_beside_it(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    method,
):
    """The call that runs a prompt beside speculating requests returns its first token alone;
    the speculative step over the others follows in the next call. A request aborted between
    the two leaves the step (its blocks are freed), and with none left the call schedules anew."""
    llm = _llm(tiny_dir, method, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30)
    engine.add_request(prompts[0], params, request_id="a")
    engine.add_request(prompts[1], params, request_id="b")
    while engine.speculator.stats.num_verify_steps == 0:
        engine.step()
    engine.add_request(prompts[2], params, request_id="c")
    first = engine.step()
    assert [o.request_id for o in first] == ["c"] and len(first[0].token_ids) == 1
    second = engine.step()
    assert sorted(o.request_id for o in second) == ["a", "b"]
    # Aborted between the two calls: the step runs without it.
    engine.add_request(prompts[3], params, request_id="d")
    assert [o.request_id for o in engine.step()] == ["d"]
    engine.abort("a")
    assert sorted(o.request_id for o in engine.step()) == ["b", "c"]
    while engine.has_unfinished():
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
