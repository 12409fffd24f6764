"""Async scheduling (engine/overlap.py) on the CPU, forced on: the same outputs as stepping
one batch at a time — greedy and seeded sampling, stops and max_tokens, requests arriving and
aborted mid-run — with steps actually run ahead, and every KV block back at the end; with a
proposer, the plain steps its controller keeps plain run ahead and the output stays plain."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.speculative.ngram import NgramConfig, NgramProposer
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_eagle3 import K, _ScriptedController, eagle_llm
from tests.unit.test_spec_engine import OracleProposer


def _llm(tiny_dir, async_scheduling):  # noqa: F811
    return LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256,
        async_scheduling=async_scheduling,
    )  # fmt: skip


def _params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=17, seed=i),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7, 11, 13]),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6),  # runs ahead once >= 6
        SamplingParams(temperature=0, max_tokens=9, logprobs=2),  # never runs ahead
    ]
    return kinds[i % len(kinds)]


def _drive(llm, prompts):  # noqa: F811
    """Add half the requests, step, add the rest mid-run, abort one; collect every delta."""
    engine = llm.engine
    got: dict[str, list[int]] = {}
    ids = []
    for i, p in enumerate(prompts[:4]):
        ids.append(engine.add_request(p, _params(i), request_id=f"r{i}").request_id)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
        if steps == 3:
            for i, p in enumerate(prompts[4:], start=4):
                engine.add_request(p, _params(i), request_id=f"r{i}")
        if steps == 6:
            engine.abort("r2")
    return got


@pytest.mark.slow
def test_async_scheduling_gives_the_same_outputs(tiny_dir, prompts):  # noqa: F811
    plain = _drive(_llm(tiny_dir, False), prompts)
    llm = _llm(tiny_dir, True)
    ahead = _drive(llm, prompts)
    assert ahead == plain
    assert llm.engine.num_steps_run_ahead > 10
    # The ledger saw every token, in prompt steps and in decode steps read with the next
    # one already launched.
    ledger = {k: (n, s, t, r) for k, n, s, t, r in llm.engine.ledger.snapshot()}
    assert sum(t for _, _, t, _ in ledger.values()) == sum(map(len, ahead.values()))
    assert ledger["decode_ahead"][0] > 10 and ledger["prefill"][0] >= 2
    assert all(s > 0 and r >= n for n, s, _, r in ledger.values())
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # and the next batch of work on the same engine still matches
    again = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8))
    want = _llm(tiny_dir, False).generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in again] == [o.token_ids for o in want]


def test_async_scheduling_is_off_by_default_on_the_cpu_and_never_ahead_of_a_fixed_k(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
):
    assert not _llm(tiny_dir, None).engine._async  # None: on CUDA only (tests/gpu)
    spec = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64,
        async_scheduling=True, speculative={"method": "ngram", "controller": "fixed"},
    )  # fmt: skip
    # A fixed k verifies drafts every step it finds some. Drafted on the host alone (no
    # lookup inside the step: device_window 0), their tokens must be on the host, so no step
    # runs ahead, whether or not the lookup found drafts. (With the lookup inside the step
    # they do: test_ngram_device.py.)
    spec.engine.speculator.use_proposer(NgramProposer(NgramConfig(device_window=0)))
    outs = spec.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=12))
    want = _llm(tiny_dir, False).generate(prompts[:3], SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert spec.engine.num_steps_run_ahead == 0


# Runs of plain steps and of steps with drafts, one pick a step, for a scripted controller.
SCRIPT = ([0] * 6 + [K] * 3 + [0] * 4 + [2] * 2) * 20


def test_eagle3_plain_steps_run_ahead_and_the_output_stays_plain(tiny_dir, prompts, reference):  # noqa: F811
    """EAGLE-3 with async scheduling: the plain steps its controller keeps plain run ahead
    (their rows deferred for the drafter from the launched step's aux streams), a step it
    gives another k is scheduled once the step before it is read; greedy output equals
    plain, the controller is asked once a step and every step is recorded at the k it ran."""
    llm = eagle_llm(tiny_dir, async_scheduling=True)
    engine = llm.engine
    controller = engine.speculator.controller = _ScriptedController(SCRIPT)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert [o.token_ids for o in outs] == reference
    spec = engine.speculator
    assert engine.num_steps_run_ahead >= 8
    assert spec.steps_by_k.get(0, 0) >= 8
    assert spec.stats.num_verify_steps > 0  # (a random drafter: its drafts are refused)
    recorded = [k for _, k, _ in controller.recorded]
    assert len(recorded) == sum(spec.steps_by_k.values()) and set(recorded) >= {0, K, 2}
    # One pick a step: the script ran no faster than the steps that decode.
    assert len(SCRIPT) - len(controller.ks) <= sum(spec.steps_by_k.values())
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


def test_host_proposer_plain_steps_run_ahead_and_the_output_stays_plain(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    reference,  # noqa: F811
):
    """The same for a host proposer (drafts the reference: every draft verified is accepted)."""
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, async_scheduling=True,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": K},
    )  # fmt: skip
    engine = llm.engine
    engine.speculator.use_proposer(OracleProposer(dict(zip(map(tuple, prompts), reference))))
    engine.speculator.controller = _ScriptedController(SCRIPT)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
    assert [o.token_ids for o in outs] == reference
    stats = engine.speculator.stats
    assert engine.num_steps_run_ahead >= 3
    assert stats.num_verify_steps > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_running_request_left_out_of_a_step_stops_running_ahead(tiny_dir):  # noqa: F811
    """Budget 2 and two decodes (b, then c): the prompt L admitted between them is given
    nothing; steps run ahead would go on without it after b ends, so none runs ahead while it
    waits, and every request ends in the step it ends in without async scheduling."""

    def drive(async_scheduling):
        llm = LLM(
            str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64,
            max_num_batched_tokens=2, async_scheduling=async_scheduling,
        )  # fmt: skip
        engine, finished = llm.engine, {}
        for rid, prompt, n in (("b", [5, 6], 60), ("a", [7, 8], 6), ("L", [*range(20, 30)], 1)):
            engine.add_request(
                prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), rid
            )
        for step in range(200):
            if step == 6:
                engine.add_request([9, 10], SamplingParams(temperature=0, max_tokens=60), "c")
            finished.update((o.request_id, step) for o in engine.step() if o.finished)
            if not engine.has_unfinished():
                return finished

    assert drive(True) == drive(False)  # L ends when b has, not after c as well


def test_no_step_is_left_ahead_once_every_request_finished(tiny_dir, prompts):  # noqa: F811
    """The last step of a run launches one more ahead before it knows its requests finish;
    that step is dropped then, not left for the next run's first step to take (with a drafter
    attached in between, it would hand the drafter a step without its hidden states)."""
    llm = _llm(tiny_dir, True)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate(prompts[:2], params)
    assert llm.engine.num_steps_run_ahead > 3
    assert llm.engine._ahead is None
    steps = llm.engine.num_steps_run_ahead
    again = llm.generate(prompts[:2], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert llm.engine._ahead is None and llm.engine.num_steps_run_ahead > steps
