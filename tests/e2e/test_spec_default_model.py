"""Speculation on the real default model keeps greedy output token for token (fp32): n-gram,
a random EAGLE-3 drafter, and the drafter shipped with the package."""

from __future__ import annotations

import json

import pytest

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED as DATASET_GROUNDED
from tests.e2e.conftest import CHAT_PROMPTS

GROUNDED = DATASET_GROUNDED + [
    "Write the numbers from 1 to 30 separated by commas.",
    "Write the alphabet in capital letters separated by spaces, twice.",
    "List the days of the week, then list them again in reverse order.",
    "Write a Python function that returns the sum of a list, then write it again with a loop.",
    "Count down from 20 to 1.",
    "Repeat the phrase 'speculative decoding is lossless' five times.",
    "What are the first ten multiples of 7?",
    "Write a limerick about a cat, then repeat it.",
    "Spell the word 'lighthouse' letter by letter.",
    "Write a short poem where every line starts with 'The sea'.",
]


@pytest.mark.slow
def test_ngram_greedy_equals_plain_on_real_model(llm):
    prompts = [
        llm.encode_chat_text(llm.apply_chat_template([{"role": "user", "content": p}]))
        for p in CHAT_PROMPTS + GROUNDED
    ]
    assert len(prompts) >= 30
    # Varied boundaries: long outputs, short max_tokens, stop strings, some sampling-free
    # requests asking for logprobs (they never speculate) in the same batches.
    params = []
    for i in range(len(prompts)):
        if i % 7 == 3:
            params.append(SamplingParams(temperature=0, max_tokens=i % 5 + 1))
        elif i % 7 == 5:
            params.append(SamplingParams(temperature=0, max_tokens=64, stop=[".", "\n\n"]))
        elif i % 7 == 6:
            params.append(SamplingParams(temperature=0, max_tokens=40, logprobs=1))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=64))
    plain = llm.generate(prompts, params)
    spec = LLM(
        dtype="float32",
        device="cpu",
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 5},
    )
    outs = spec.generate(prompts, params)
    for p, a, b in zip(prompts, plain, outs):
        assert b.token_ids == a.token_ids, f"diverged on prompt {p[-12:]}"
        assert b.text == a.text and b.finish_reason == a.finish_reason
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.accept_length > 1.0
    grounded = [
        o.metrics["accept_length"] for o in outs[len(CHAT_PROMPTS) :] if o.metrics["accept_length"]
    ]
    assert max(grounded) > 1.5  # copying the input is what n-gram lookup is for


EAGLE_PARAMS = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def eagle_plain(llm):
    """The random drafter test's prompts and their plain greedy outputs: what the chain and the
    tree must both give."""
    prompts = [
        llm.encode_chat_text(llm.apply_chat_template([{"role": "user", "content": p}]))
        for p in CHAT_PROMPTS[:3] + GROUNDED[:2]
    ]
    return prompts, llm.generate(prompts, EAGLE_PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 3])
def test_eagle3_greedy_equals_plain_on_real_model(eagle_plain, topk):
    """Losslessness does not depend on the drafter's quality: a random EAGLE-3 drafter for the
    real model (chain, and a tree of 3 candidates per step) keeps greedy output exact."""
    from outrider.executor.drafter import Eagle3Drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    prompts, plain = eagle_plain
    spec = LLM(
        dtype="float32",
        device="cpu",
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4},
    )
    target = spec.engine.checkpoint.config
    spec.engine.speculator.use_proposer(
        Eagle3Drafter(
            random_drafter(target, draft_vocab=8000), spec.engine.runner, topk=topk, num_steps=3
        )
    )
    outs = spec.generate(prompts, EAGLE_PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.speculator.stats.num_verify_steps > 0


@pytest.mark.slow
def test_the_shipped_drafter_serves_the_default_model(llm):
    """speculative={"method": "eagle3", "controller": "fixed"} with no draft path picks the drafter shipped for the
    default model: SGLang layout, <= 40 MB, passes the doctor, keeps greedy output exact (chain
    and tree) and drafts tokens the target accepts (a random drafter's accept length is ~1)."""
    from outrider.speculative.eagle3 import SHIPPED_DIR, shipped_drafter
    from outrider.speculative.eagle3_doctor import diagnose

    path = shipped_drafter(llm.engine.checkpoint.config)
    assert path.parent == SHIPPED_DIR and "eagle3" in path.name
    assert sum(f.stat().st_size for f in path.iterdir()) <= 40 * 2**20
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["outrider"]["layout"] == "sglang"
    report = diagnose(path, llm.engine.checkpoint)
    assert report.ok, str(report)
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = llm.chat(convs, params)
    for spec in ({"num_draft_tokens": 4}, {"num_draft_tokens": 8, "topk": 3, "num_steps": 4}):
        eagle = LLM(
            dtype="float32",
            device="cpu",
            speculative={"method": "eagle3", "controller": "fixed", **spec},
        )
        outs = eagle.chat(convs, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], spec
        assert eagle.engine.speculator.stats.accept_length > 1.8, spec
