"""Speculative steps launched ahead of their read (engine/overlap.py, SpecStep.launch_after),
on the CPU with async scheduling forced on: EAGLE-3 chains whose rows are plain greedy or sample
from their parameters alone run one step ahead on the device's own acceptance. The output
equals the same engine stepping one batch at a time (and plain greedy), with stops,
max_tokens, seeded and logprob rows beside, requests arriving and aborted mid-run; sampled
rows keep their distribution; every KV block comes back. (The drafts a step run ahead
verifies: test_spec_eagle3.py's dense recomputation.)"""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.engine.block_manager import BlockManager
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_eagle3 import eagle_llm


def _free(engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and engine._ahead is None


def test_eagle3_steps_run_ahead_and_the_output_stays_plain(tiny_dir, prompts, reference):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=48)
    sync = eagle_llm(tiny_dir, async_scheduling=False)
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert [w[:20] for w in want] == reference
    llm = eagle_llm(tiny_dir, async_scheduling=True)
    engine = llm.engine
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    # Every step but the prefill and the first (the one that launches the others).
    steps = sum(engine.speculator.steps_by_k.values())
    assert engine.num_steps_run_ahead >= steps - 2
    assert engine.speculator.stats.num_verify_steps == sync.engine.speculator.stats.num_verify_steps
    assert _free(engine)


def _params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=33, stop_token_ids=[7, 11, 13, 130]),
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0, max_tokens=36, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=17, seed=i),
        SamplingParams(temperature=0, max_tokens=9, logprobs=2),
    ]
    return kinds[i % len(kinds)]


def _drive(llm, prompts, sampled: bool):  # noqa: F811
    """Add some requests, step, add the rest mid-run, abort one; collect every delta."""
    engine = llm.engine
    got: dict[str, list[int]] = {}
    kinds = range(6) if sampled else range(4)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(p, _params(kinds[i % len(kinds)]), request_id=f"r{i}")
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
        if steps == 12:
            for i, p in enumerate(prompts[3:], start=3):
                engine.add_request(p, _params(kinds[i % len(kinds)]), request_id=f"r{i}")
        if steps == 16:
            engine.abort("r1")
    return got


def test_stops_arrivals_aborts_and_other_rows_beside_steps_run_ahead(tiny_dir, prompts):  # noqa: F811
    for sampled in (False, True):
        want = _drive(eagle_llm(tiny_dir, async_scheduling=False), prompts, sampled)
        llm = eagle_llm(tiny_dir, async_scheduling=True)
        got = _drive(llm, prompts, sampled)
        # r1 (greedy) is aborted after a number of calls, whose steps differ: one of the two
        # outputs is a start of the other.
        a, b = sorted((got.pop("r1"), want.pop("r1")), key=len)
        assert a == b[: len(a)], sampled
        assert got == want, sampled
        assert llm.engine.num_steps_run_ahead >= (3 if sampled else 8), sampled
        assert _free(llm.engine)


def test_sampled_rows_run_ahead_and_keep_their_distribution(tiny_dir, prompts, reference):  # noqa: F811
    """Unseeded sampled rows verify from their parameters alone, so their steps run ahead too.
    top_k=1 makes the sampler's distribution the argmax's: those rows, sampled through the
    rejection sampler on inputs the device advanced, give the greedy tokens exactly; rows at
    temperature 0.9 end at max_tokens or EOS, and every block comes back."""
    llm = eagle_llm(tiny_dir, async_scheduling=True)
    engine = llm.engine
    step = engine.runner.spec_step
    fixed_ahead = []  # steps run ahead whose sampled rows were decided between the replays
    run = step._step_no_sync

    def spy(padded, k, k_draft, fixup=None):
        fixed_ahead.append(fixup is not None)
        return run(padded, k, k_draft, fixup)

    step._step_no_sync = spy
    one_hot = SamplingParams(temperature=1.0, top_k=1, max_tokens=20)
    warm = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20)
    params = [one_hot if i % 2 == 0 else warm for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (o, want) in enumerate(zip(outs, reference)):
        if i % 2 == 0:
            assert o.token_ids == want, i
        else:
            assert 0 < len(o.token_ids) <= 20
    assert any(outs[i].token_ids != reference[i] for i in range(1, len(prompts), 2))
    assert engine.num_steps_run_ahead >= 10 and sum(fixed_ahead) >= 10
    assert _free(engine)


def test_logprobs_of_steps_run_ahead_equal_stepping_one_batch_at_a_time(tiny_dir, prompts):  # noqa: F811
    """Rows asking for logprobs run ahead: each emitted token's logprobs come back packed in
    the step's read, the same as stepping one batch at a time."""
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=3) for _ in prompts[:4]]
    params[1] = SamplingParams(temperature=0.8, max_tokens=24, logprobs=2)  # sampled beside

    def run(async_scheduling):
        llm = eagle_llm(tiny_dir, async_scheduling=async_scheduling)
        return llm, llm.generate(prompts[:4], params)

    _, want = run(False)
    llm, got = run(True)
    assert llm.engine.num_steps_run_ahead >= 8
    for i in (0, 2, 3):  # greedy: the same tokens and the same logprobs
        assert got[i].token_ids == want[i].token_ids
        lp_got, lp_want = got[i].outputs[0].logprobs, want[i].outputs[0].logprobs
        assert len(lp_got) == len(got[i].token_ids)
        for a, b in zip(lp_got, lp_want):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-5 for t in a)
    sampled = got[1].outputs[0]
    assert len(sampled.logprobs) == len(sampled.token_ids)
    assert all(t in lp and len(lp) >= 2 for t, lp in zip(sampled.token_ids, sampled.logprobs))


def test_seeded_rows_run_ahead_and_draw_what_one_batch_at_a_time_draws(tiny_dir, prompts):  # noqa: F811
    """A seeded row's noise is keyed by its output position, which the step before a step
    run ahead decides on the device: the device adds it, and every seeded request gives the
    tokens it gives stepping one batch at a time (and alone)."""
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=7 + i)
        for i in range(len(prompts))
    ]

    def run(async_scheduling):
        llm = eagle_llm(tiny_dir, async_scheduling=async_scheduling)
        return llm, [o.token_ids for o in llm.generate(prompts, params)]

    _, want = run(False)
    llm, got = run(True)
    assert got == want
    assert llm.engine.num_steps_run_ahead >= 15
    alone = llm.generate([prompts[2]], params[2])[0].token_ids
    assert alone == want[2]


def _arrive(llm, prompts, params, every: int = 3):  # noqa: F811
    """Two requests, then one more every `every` steps; each one's tokens."""
    engine = llm.engine
    got: dict[str, list[int]] = {}
    queue = list(enumerate(prompts))
    steps = 0
    while queue or engine.has_unfinished():
        if queue and (steps < 2 or steps % every == 0):
            i, p = queue.pop(0)
            engine.add_request(p, params(i), request_id=f"r{i}")
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    return got


def test_arrivals_compute_their_prompts_beside_and_join_steps_run_ahead(tiny_dir, prompts):  # noqa: F811
    """A request that arrives while steps run ahead computes its prompt beside them and joins
    the step after, in the row of a finished request or past the others: the steps keep
    running ahead through arrivals, and every output is the one-batch-at-a-time engine's."""

    def params(i):
        if i % 4 == 3:  # seeded, sampled: its noise keyed by output positions
            return SamplingParams(temperature=0.8, max_tokens=12 + 3 * i, seed=i)
        return SamplingParams(temperature=0, max_tokens=12 + 3 * i)

    want = _arrive(eagle_llm(tiny_dir, async_scheduling=False), prompts, params)
    llm = eagle_llm(tiny_dir, async_scheduling=True)
    engine = llm.engine
    assert _arrive(llm, prompts, params) == want
    spec = engine.speculator
    assert spec.num_rows_joined >= len(prompts) - 3
    # The steps that did not run ahead: the first, and those after a read that ended them all.
    steps = sum(spec.steps_by_k.values())
    assert engine.num_steps_run_ahead >= steps - 6, (engine.num_steps_run_ahead, steps)
    assert _free(engine)


@pytest.mark.parametrize(
    "case, options",
    [
        ("chunked", {"max_num_batched_tokens": 24}),  # long prompts beside, a chunk a step
        ("short pool", {"num_blocks": 16}),  # joins and chunks that do not fit wait
        ("host rows", {}),  # arrivals asking for logprobs or penalties stop running ahead
    ],
)
def test_arrivals_beside_steps_run_ahead_in_every_case(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    monkeypatch,
    case,
    options,
):
    short = []  # allocations the pool refused
    allocate = BlockManager.allocate

    def counted(self, req, n):
        ok = allocate(self, req, n)
        short.append(not ok)
        return ok

    monkeypatch.setattr(BlockManager, "allocate", counted)

    def params(i):
        if case == "host rows" and i % 3 == 2:
            extra = {"logprobs": 1} if i % 2 else {"presence_penalty": 0.5}
            return SamplingParams(temperature=0, max_tokens=10 + 2 * i, **extra)
        return SamplingParams(temperature=0, max_tokens=10 + 2 * i)

    want = _arrive(eagle_llm(tiny_dir, async_scheduling=False, **options), prompts, params, 2)
    llm = eagle_llm(tiny_dir, async_scheduling=True, **options)
    assert _arrive(llm, prompts, params, 2) == want
    engine = llm.engine
    assert engine.num_steps_run_ahead > 0 and _free(engine)
    if case == "chunked":
        assert engine.speculator.num_rows_joined > 0
    if case == "short pool":
        assert any(short)


@pytest.mark.parametrize("topk,steps", [(2, 3), (3, 2)])
def test_eagle3_trees_run_ahead_and_the_output_stays_plain(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    reference,  # noqa: F811
    topk,
    steps,
):
    """Greedy trees launch each step on the last one's accepted path and next tree, still on
    the device (its KV moves done there): the output equals plain decoding and the same engine
    stepping one batch at a time, with paths of accepted nodes among them."""
    params = SamplingParams(temperature=0, max_tokens=20)
    sync = eagle_llm(tiny_dir, topk=topk, num_steps=steps, async_scheduling=False)
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert want == reference
    llm = eagle_llm(tiny_dir, topk=topk, num_steps=steps, async_scheduling=True)
    engine = llm.engine
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = engine.speculator
    assert spec.stats.num_accepted_tokens > 0  # some paths past the root
    assert spec.stats.num_verify_steps == sync.engine.speculator.stats.num_verify_steps
    assert engine.num_steps_run_ahead >= sum(spec.steps_by_k.values()) - 2
    assert _free(engine)


def test_trees_beside_sampled_rows_arrivals_and_aborts(tiny_dir, prompts):  # noqa: F811
    """A tree step decides greedy rows alone: steps with a sampled, seeded or logprob row
    (and requests joining with one) are read before the next is launched, the rest run
    ahead; the outputs are stepping one batch at a time's."""
    for sampled in (False, True):
        want = _drive(eagle_llm(tiny_dir, topk=2, num_steps=3, async_scheduling=False), prompts,
                      sampled)  # fmt: skip
        llm = eagle_llm(tiny_dir, topk=2, num_steps=3, async_scheduling=True)
        got = _drive(llm, prompts, sampled)
        a, b = sorted((got.pop("r1"), want.pop("r1")), key=len)  # aborted after a few calls
        assert a == b[: len(a)], sampled
        assert got == want, sampled
        assert llm.engine.num_steps_run_ahead >= 3, sampled
        assert _free(llm.engine)


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram"])
def test_a_step_run_ahead_loads_what_the_host_would_have_loaded(tiny_dir, prompts, kind):  # noqa: F811
    """What the device wrote for a step launched before its predecessor was read (SpecStep.
    advance_no_sync) equals what `load` writes for the host's view of that step once the
    predecessor is read (Speculator.batch_after): each live row's tokens, positions, KV slots,
    lengths, draft counts and, for trees, parents. Acceptance aside: a wrong position or
    parent changes only the drafts' rows, which a random drafter's output rarely shows."""
    if kind == "ngram":
        llm = LLM(
            str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256,
            async_scheduling=True,
            speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4},
        )  # fmt: skip
    else:
        topk = 3 if kind == "tree" else 1
        llm = eagle_llm(
            tiny_dir, topk=topk, num_steps=2 if topk > 1 else None, async_scheduling=True
        )
    engine = llm.engine
    spec, step = engine.speculator, engine.runner.spec_step
    after_of = spec.batch_after
    compared = []

    def check(batch, output, launched):
        after = after_of(batch, output, launched)
        s, padded, t = step.inputs, launched.padded, 1 + launched.k
        n = padded * t
        names = ["input_ids", "positions", "slot_mapping"]
        device = [getattr(s, x)[:n].view(padded, t).clone() for x in names]
        device += [s.seq_lens[:padded].clone(), step.num_drafts[:padded].clone()]
        if step.tree is not None:
            device.append(step.parents[:padded].clone())
        # (The step after `after` loads its own tables: load_after.)
        step.load(after, launched.k, padded)
        host = [getattr(s, x)[:n].view(padded, t).clone() for x in names]
        host += [s.seq_lens[:padded].clone(), step.num_drafts[:padded].clone()]
        if step.tree is not None:
            host.append(step.parents[:padded].clone())
        for x, v in zip(names, device[:3]):  # back as the device had them
            getattr(s, x)[:n].copy_(v.view(-1))
        s.seq_lens[:padded].copy_(device[3])
        step.num_drafts[:padded].copy_(device[4])
        if step.tree is not None:
            step.parents[:padded].copy_(device[5])
        for i, seq in enumerate(after.seqs):
            if seq.request.is_finished:
                continue  # its row kept, its output dropped
            for name, d, h in zip(
                ["ids", "pos", "slots", "lens", "drafts", "parents"], device, host
            ):
                assert torch.equal(d[i], h[i]), (kind, name, i, d[i].tolist(), h[i].tolist())
            compared.append(i)
        return after

    spec.batch_after = check
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert len(compared) > 40
    assert spec.stats.num_accepted_tokens > 0
