"""Seeded sampling keyed by (seed, output position): a request's draws do not depend on its
batch, the step that makes them or the drafts beside them, so speculative sampled output equals
plain sampled output for the same seed, and the draws keep the target's law."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.executor.sampler import keyed_draws_no_sync, keyed_noise_no_sync
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_proposer_plugin import OracleProposer, register  # noqa: F401 (fixture)
from tests.unit.test_spec_eagle3 import eagle_llm

CPU = torch.device("cpu")


def test_keyed_noise_is_a_function_of_its_key():
    a = keyed_noise_no_sync([(7, 3), (7, 4), (8, 3)], 1000, CPU)
    b = keyed_noise_no_sync([(8, 3), (7, 3)], 1000, CPU)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert bool((a > 0).all())
    big = keyed_noise_no_sync([(s, 0) for s in range(50)], 2000, CPU).double()
    assert abs(float(big.mean()) - 1.0) < 0.02 and abs(float(big.var()) - 1.0) < 0.05


def test_keyed_draws_follow_the_target_law():
    vocab, trials = 10, 8000
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(1)), 0)
    draws = keyed_draws_no_sync(p.repeat(trials, 1), [(s, 5) for s in range(trials)])
    counts = torch.bincount(draws, minlength=vocab).double()
    expected = p.double() * trials
    chi2 = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((vocab - 1) / 2.0, dtype=torch.float64)
    assert float(torch.special.gammaincc(df, chi2 / 2)) > 1e-4, (counts, expected)


def _seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=100 + i)
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
        "eagle3_chain",
        "eagle3_tree",
    ],  # fmt: skip
    ids=["ngram", "eagle3_chain", "eagle3_tree"],
)
def test_seeded_speculative_sampling_equals_seeded_plain_sampling(tiny_dir, prompts, speculative):  # noqa: F811
    prompts = prompts[:5]
    params = _seeded(len(prompts))
    plain = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert plain.generate([prompts[2]], params[2])[0].outputs[0].token_ids == want[2]
    if speculative == "eagle3_chain":
        llm = eagle_llm(tiny_dir)
    elif speculative == "eagle3_tree":
        llm = eagle_llm(tiny_dir, topk=2, num_steps=3)
    else:
        llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256,
                  speculative=speculative)  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.engine.speculator.stats.num_verify_steps > 0


def test_drafts_equal_to_the_keyed_draws_are_all_accepted(tiny_dir, prompts, register):  # noqa: F811
    """An oracle drafting what seeded plain sampling drew: every draft is accepted (coupled),
    where rejection sampling would accept each with probability p(x) only."""
    prompts = prompts[:4]
    params = _seeded(len(prompts))
    plain = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    table = {tuple(p): w for p, w in zip(prompts, want)}
    register("keyedoracle", lambda config, runner, checkpoint: OracleProposer(table))
    spec = {"method": "keyedoracle", "num_draft_tokens": 4, "controller": "fixed"}
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens
