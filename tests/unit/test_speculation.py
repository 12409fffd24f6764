"""The engine's Speculator on a tiny random checkpoint, through its public methods: off without
a proposer, lossless and counted with one, the k it chooses and drafts for, accepted runs cut
at a stop token, the per-sequence path, and what it forgets."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq, SeqDrafts, StepOutput
from outrider.speculative.step_profile import StepProfile
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_engine import OracleProposer

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def _llm(tiny_dir, controller: str = "fixed", method: str | None = "ngram") -> LLM:  # noqa: F811
    spec = {"method": method, "controller": controller, "num_draft_tokens": K}
    return LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, speculative=spec)


class ForgetfulOracle(OracleProposer):
    """The oracle, remembering which requests it was told to forget."""

    def __init__(self, continuations):
        super().__init__(continuations)
        self.forgotten: list[str] = []

    def forget(self, request_id):
        self.forgotten.append(request_id)


def _flat_profile(verify_factor: float) -> StepProfile:
    """Every k costs verify_factor times a plain step, at batch sizes 1 and 4."""
    return StepProfile({b: {j: 10.0 * (verify_factor if j else 1.0) for j in range(K + 1)}
                        for b in (1, 4)})  # fmt: skip


def test_without_a_proposer_it_is_off(tiny_dir, prompts, reference):  # noqa: F811
    llm = _llm(tiny_dir, method=None)
    spec = llm.engine.speculator
    assert spec.proposer is None and spec.controller is None
    assert spec.before_schedule(llm.engine.scheduler.running) == (None, 0)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert spec.stats.num_verify_steps == 0 and spec.steps_by_k == {} and spec.last_k == 0


def test_ngram_is_lossless_and_every_verify_is_counted(tiny_dir, prompts, reference):  # noqa: F811
    llm = _llm(tiny_dir)
    spec = llm.engine.speculator
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert spec.controller is None  # fixed: k every step
    assert set(spec.steps_by_k) <= {0, K} and spec.steps_by_k[K] > 0
    # The engine-wide counters are the sum of the requests' own.
    for name in ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(spec.stats, name) == sum(o.metrics[name] for o in outs) > 0, name
    before = spec.stats
    spec.reset_stats()
    assert spec.stats.num_verify_steps == 0 and before.num_verify_steps > 0


def test_a_host_proposer_drafts_for_the_k_the_controller_chooses(tiny_dir, prompts, reference):  # noqa: F811
    llm = _llm(tiny_dir, controller="adaptive")
    engine, spec = llm.engine, llm.engine.speculator
    spec.use_proposer(OracleProposer({tuple(p): r for p, r in zip(prompts, reference)}))
    req = engine.add_request(prompts[2], GREEDY)
    engine.step()  # the prefill: one token out, decoding from here
    running = engine.scheduler.running

    spec.controller.set_profile(_flat_profile(verify_factor=100.0))
    assert spec.before_schedule(running) == (0, 0)  # speculation loses: plain, nothing drafted
    assert not req.drafts

    spec.controller.set_profile(_flat_profile(verify_factor=1.0))
    assert spec.before_schedule(running) == (K, 0)  # verify as cheap as plain: the most k
    assert req.drafts.token_ids == reference[2][1 : 1 + K]

    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == reference[2]
    assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens > 0


def test_accepted_runs_are_cut_at_a_stop_token(tiny_dir):  # noqa: F811
    spec = _llm(tiny_dir).engine.speculator
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[40])
    req = Request(prompt_token_ids=[5, 6, 7], params=params, output_token_ids=[8])
    req.num_computed_tokens = 3
    drafts = SeqDrafts.chain([30, 40, 50])
    seq = ScheduledSeq(req, [8, 30, 40, 50], 3, [0], sample=True, drafts=drafts)
    batch = ScheduledBatch(ForwardMode.VERIFY, [seq])
    # Every draft accepted, then the bonus token: the stop id is the second of four tokens.
    output = StepOutput([req.request_id], [[30, 40, 50, 60]], num_accepted=[3])
    spec.trim_output(batch, output)
    assert output.token_ids == [[30, 40]] and output.num_accepted == [2]
    # Acceptance counts what the verify accepted, before the cut.
    assert (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) == (3, 3)
    assert (req.metrics.num_draft_tokens, req.metrics.num_accepted_tokens) == (3, 3)
    assert spec.last_k == K and spec.steps_by_k == {K: 1}


def test_verified_per_sequence_the_output_is_the_same(tiny_dir, prompts, reference):  # noqa: F811
    llm = _llm(tiny_dir)
    spec, runner = llm.engine.speculator, llm.engine.runner
    spec.verify_per_sequence()
    calls = []
    run_spec = runner.run_spec
    runner.run_spec = lambda *a: calls.append(1) or run_spec(*a)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    assert not calls and spec.stats.num_verify_steps > 0


@pytest.mark.parametrize("abort", [False, True])
def test_the_proposer_forgets_finished_and_aborted_requests(tiny_dir, prompts, reference, abort):  # noqa: F811
    engine = _llm(tiny_dir).engine
    oracle = ForgetfulOracle({tuple(p): r for p, r in zip(prompts, reference)})
    engine.speculator.use_proposer(oracle)
    req = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    assert oracle.forgotten == []
    if abort:
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    assert oracle.forgotten == [req.request_id]


class NoDrafts:
    """A host proposer whose lookups never find anything."""

    name = "none"
    on_device = False
    aux_layers: tuple[int, ...] = ()
    writes_kv = False
    topk = 1

    def __init__(self):
        self.asked = 0

    def positions_needed(self, k):
        return 1 + k

    def propose(self, requests, max_draft_tokens):
        self.asked += 1
        return [None] * len(requests)

    def observe(self, batch, output):
        pass

    def forget(self, request_id):
        pass


def test_steps_whose_lookups_find_nothing_teach_the_controller(tiny_dir, prompts, reference):  # noqa: F811
    """A step that chose k but whose host proposer found no drafts runs plain; its missing
    drafts count as rejected, so the controller turns speculation off within a few such steps
    (told nothing, it chose k at every step, each a plain step that cannot run ahead)."""
    llm = _llm(tiny_dir, controller="adaptive")
    spec = llm.engine.speculator
    nothing = NoDrafts()
    spec.use_proposer(nothing)
    spec.controller.set_profile(_flat_profile(verify_factor=1.5))  # pays at the prior's 0.6
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = llm.generate([prompts[0]], params)[0]
    assert len(out.token_ids) == 60
    assert spec.stats.num_verify_steps == 0  # nothing was ever verified
    chosen = spec.controller.snapshot()["steps"]
    spec_steps = sum(n for k, n in chosen.items() if k)
    assert 0 < nothing.asked == spec_steps <= 15, chosen
    assert chosen.get(0, 0) >= 40
    assert spec.controller.expected(out.request_id, K) < 1.5
