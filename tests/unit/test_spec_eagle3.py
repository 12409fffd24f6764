"""EAGLE-3 proposals through the whole engine on a tiny random target and a random drafter:
greedy output == plain, the draft KV stays aligned with the target's positions across extends,
verifies and rollbacks (the engine's drafts equal a dense recomputation from scratch), KV
accounting, and clear errors for a drafter built for another target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode
from outrider.executor.drafter import Eagle3Drafter
from outrider.loaders.hf_config import TransformerConfig
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
from outrider.speculative.base import DeviceDrafter
from tests.tiny import tiny_hf_config
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def random_drafter(target: TransformerConfig, draft_vocab: int = 300, seed: int = 0) -> Eagle3Draft:
    """Random weights; the draft vocabulary every other target id plus the first ones."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.for_target(target, draft_vocab)).float().eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p)
            )
        ids = torch.cat(
            [torch.arange(0, target.vocab_size, 2), torch.arange(1, target.vocab_size, 2)]
        )
        ids = ids[:draft_vocab].sort().values
        draft.d2t.copy_(ids - torch.arange(draft_vocab))
        draft.t2d.zero_()
        draft.t2d[ids] = True
    return draft


def eagle_llm(
    tiny_dir,  # noqa: F811
    draft: Eagle3Draft | None = None,
    topk: int = 1,
    num_steps: int | None = None,
    **options,
) -> LLM:
    options = {"num_blocks": 256, **options}
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu",
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": K}, **options,
    )  # fmt: skip
    engine = llm.engine
    target = engine.checkpoint.config
    drafter = Eagle3Drafter(draft or random_drafter(target), engine.runner, topk, num_steps)
    engine.speculator.use_proposer(drafter)
    return llm


def test_eagle3_greedy_equals_plain(tiny_dir, prompts, reference):  # noqa: F811
    llm = eagle_llm(tiny_dir)
    # The speculative step and the tree code call only what the protocol declares.
    assert isinstance(llm.engine.speculator.proposer, DeviceDrafter)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 0 and stats.num_draft_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_eagle3_sampling_keeps_seeded_requests_valid(tiny_dir, prompts):  # noqa: F811
    llm = eagle_llm(tiny_dir)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    outs = llm.generate(prompts[:4], params)
    assert all(len(o.token_ids) > 0 and all(0 <= t < 512 for t in o.token_ids) for o in outs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def _dense_attend(q, k, v):
    """Causal attention over one sequence, GQA by repeating kv heads: [T, h, d] -> [T, h * d]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def _dense_chain(llm: LLM, draft: Eagle3Draft, tokens: list[int], k: int) -> list[int]:
    """The drafts for a sequence whose KV covers tokens[:-1] (tokens[-1] is the root),
    recomputed from scratch: one target forward for the aux features, then the draft over
    the whole sequence with full causal attention, one more row per chain step."""
    from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq

    runner = llm.engine.runner
    c = len(tokens) - 1
    req = Request(prompt_token_ids=tokens[:c], params=GREEDY)
    blocks = list(range(runner.num_blocks - 8, runner.num_blocks))  # out of the engine's way
    batch = ScheduledBatch(ForwardMode.PREFILL, [ScheduledSeq(req, tokens[:c], 0, blocks, True)])
    with torch.inference_mode():
        _, aux, _ = runner.forward(batch, runner.aux_layers)
        hidden = draft.fc(torch.cat(aux, dim=-1))  # [c, H]
        ids = list(tokens[1:])  # row p takes the token after position p
        drafts = []
        for _ in range(k):
            n = hidden.shape[0]
            normed, summed = draft(torch.tensor(ids), torch.arange(n), hidden, attend=_dense_attend)
            nxt = int(draft.to_target_ids(draft.compute_logits(normed[-1:]).argmax(-1)))
            drafts.append(nxt)
            ids.append(nxt)
            hidden = torch.cat([hidden, summed[-1:]])
    return drafts


def _next_drafts(engine, req):
    """The drafts req verifies next: its own, or those of the step launched ahead for it, which
    starts at its computed tokens from its last token (the root)."""
    if engine._ahead is not None and engine._ahead.batch.mode == ForwardMode.VERIFY:
        seq = next(s for s in engine._ahead.batch.seqs if s.request is req)
        assert seq.start_pos == req.num_computed_tokens
        assert seq.token_ids[0] == req.all_token_ids[-1]
        return seq.drafts
    return req.drafts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eagle3_drafts_match_a_dense_recomputation(tiny_dir, prompts, async_scheduling):  # noqa: F811
    """After prefill, several verifies with accepts and rejects, and chunked prompts, the
    engine's next drafts equal the draft run from scratch on the same tokens. With async
    scheduling the steps run ahead: the drafts each of those verifies (which the host sees
    once the step before is read) are checked alike."""
    llm = eagle_llm(tiny_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    reqs = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40)) for p in prompts[:5]
    ]
    checked = 0
    for _ in range(12):
        engine.step()
        for r in reqs:
            d = None if r.is_finished else _next_drafts(engine, r)
            if r.is_finished or not d or r.num_computed_tokens != r.num_tokens - 1:
                continue
            want = _dense_chain(llm, engine.speculator.proposer.draft, r.all_token_ids, d.num_nodes)
            assert d.token_ids == want, (r.request_id, r.num_tokens)
            checked += 1
    assert checked >= 10
    assert (engine.num_steps_run_ahead >= 5) == async_scheduling


class _ScriptedController:
    """Chooses k from a script, one entry per decision (then K); learns nothing, keeps the
    steps the engine records."""

    def __init__(self, ks: list[int]) -> None:
        self.ks = list(ks)
        self.recorded: list[tuple[int, int, float]] = []
        self.asked: list[tuple[int, tuple[bool, ...] | None]] = []  # (k chosen, drafted)

    def choose(self, request_ids, prompts=False, drafted=None) -> int:  # noqa: F811 (not the fixture)
        k = self.ks.pop(0) if self.ks else K
        self.asked.append((k, None if drafted is None else tuple(drafted)))
        return k

    def observe(self, request_id, num_drafts, num_accepted) -> None:
        pass

    def record_step(self, batch_size, k, ms) -> None:
        self.recorded.append((batch_size, k, ms))

    def record_prompts(self, batch_size, ms, alone) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_after_plain_steps_match_a_dense_recomputation(tiny_dir, prompts, async_scheduling):  # noqa: F811
    """Speculation off for several steps, then on again: the drafter kept the plain steps' rows
    and extends over them before the step that drafts, so its first drafts after the gap equal
    the draft run from scratch (stale draft KV there made them differ). With async scheduling
    the plain steps run ahead, their rows kept from the launched steps' aux streams."""
    llm = eagle_llm(tiny_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.speculator.controller = _ScriptedController([0] * 7)
    reqs = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40)) for p in prompts[:3]
    ]
    for _ in range(8):  # the prompts' prefill, then 7 plain steps
        engine.step()
    assert engine.speculator.last_k == 0 and all(r.drafts is None for r in reqs)
    assert (engine.num_steps_run_ahead >= 5) == async_scheduling
    engine.step()  # k = K: drafts inside the step, from the KV of every position
    checked = 0
    for r in reqs:
        d = _next_drafts(engine, r)
        assert d is not None and not r.is_finished
        want = _dense_chain(llm, engine.speculator.proposer.draft, r.all_token_ids, d.num_nodes)
        assert d.token_ids == want, (r.request_id, r.num_tokens)
        checked += 1
    assert checked == 3
    for _ in range(6):  # and the verifies after it keep the chain right
        engine.step()
    for r in reqs:
        d = _next_drafts(engine, r)
        if d and not r.is_finished and r.num_computed_tokens == r.num_tokens - 1:
            want = _dense_chain(llm, engine.speculator.proposer.draft, r.all_token_ids,
                                d.num_nodes)  # fmt: skip
            assert d.token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_controller_is_told_which_rows_hold_drafts(tiny_dir, prompts, async_scheduling):  # noqa: F811
    """After plain steps no row holds drafts (the step that turns speculation on only drafts);
    after a speculative step every row does: what the controller prices such rows by."""
    llm = eagle_llm(tiny_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    controller = engine.speculator.controller = _ScriptedController([0] * 4)
    reqs = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40)) for p in prompts[:3]
    ]
    for _ in range(12):
        engine.step()
    assert not any(r.is_finished for r in reqs)
    asked = controller.asked
    first_on = next(i for i, (k, _) in enumerate(asked) if k > 0)
    assert first_on >= 4 and all(d is not None for _, d in asked)
    # Through the plain steps and the pick that turns speculation on: no drafts anywhere.
    assert all(not any(d) for _, d in asked[: first_on + 1]), asked
    # Once a speculative step has drafted, every row holds drafts at every pick.
    assert len(asked) > first_on + 2 and all(all(d) for _, d in asked[first_on + 1 :]), asked
    assert all(len(d) == 3 for _, d in asked)


def test_a_catch_up_is_not_charged_to_the_step_k(tiny_dir, prompts):  # noqa: F811
    """The forward over deferred rows before a speculative step is a cost of turning
    speculation on, not of k: the controller records the step without it."""
    import time

    llm = eagle_llm(tiny_dir)
    engine = llm.engine
    controller = engine.speculator.controller = _ScriptedController([0] * 4)
    drafter = engine.speculator.proposer
    catch_up = drafter.catch_up

    def slow_catch_up():
        if drafter._deferred:
            time.sleep(0.5)
        catch_up()

    drafter.catch_up = slow_catch_up
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=30))
    for _ in range(5):  # prefill, then 4 plain steps: their rows deferred
        engine.step()
    t0 = time.perf_counter()
    engine.step()  # k = K: catches up (slowly), then the speculative step
    wall_ms = (time.perf_counter() - t0) * 1e3
    batch, k, ms = controller.recorded[-1]
    assert (batch, k) == (1, K)
    assert wall_ms >= 500 and ms < wall_ms - 450


def test_a_prefill_step_runs_no_draft_forward(tiny_dir, prompts):  # noqa: F811
    """A prompt's first token leaves the engine without waiting for the drafter: its forward
    over the prompt runs at the start of the next step, which drafts the request inside."""
    llm = eagle_llm(tiny_dir)
    engine, drafter = llm.engine, llm.engine.speculator.proposer
    forwards = []
    run_rows = drafter.run_rows
    drafter.run_rows = lambda *a, **kw: (forwards.append(a[0].shape[0]), run_rows(*a, **kw))[1]
    reqs = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20)) for p in prompts[:2]
    ]
    deltas = engine.step()  # the prompts' prefill
    assert {d.request_id for d in deltas} == {r.request_id for r in reqs}
    assert all(len(r.output_token_ids) == 1 and r.drafts is None for r in reqs)
    assert forwards == []
    engine.step()  # catch up over both prompts (one forward), verify the roots, draft inside
    assert forwards[0] == sum(len(r.prompt_token_ids) for r in reqs)
    assert all(r.drafts is not None and r.drafts.num_nodes == K for r in reqs)


def test_a_prefill_beside_verified_drafts_drafts_them_again(tiny_dir, prompts):  # noqa: F811
    """A running request whose drafts a prefill step verified gets its next drafts from that
    step, as the dense draft would: a prefill does not cost it a step without drafts."""
    llm = eagle_llm(tiny_dir)
    engine = llm.engine
    first = engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=40))
    for _ in range(3):
        engine.step()
    assert first.drafts is not None
    second = engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=40))
    # The new prompt's prefill, then the step verifying the first request's drafts.
    assert [o.request_id for o in engine.step()] == [second.request_id]
    assert [o.request_id for o in engine.step()] == [first.request_id]
    d = first.drafts
    assert d is not None and not first.is_finished
    want = _dense_chain(llm, engine.speculator.proposer.draft, first.all_token_ids, d.num_nodes)
    assert d.token_ids == want


def test_eagle3_rejects_a_drafter_for_another_target(tiny_dir):  # noqa: F811
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64)
    other = TransformerConfig.from_hf_dict(tiny_hf_config(hidden_size=64, intermediate_size=128))
    with pytest.raises(ValueError, match="hidden size 64"):
        Eagle3Drafter(random_drafter(other), llm.engine.runner)


def test_no_shipped_drafter_for_another_model_says_what_to_do(tiny_dir):  # noqa: F811
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64)
    target = llm.engine.runner.model_config
    with pytest.raises(
        ValueError, match=rf"no EAGLE-3 drafter ships .*hidden {target.hidden_size}"
    ):
        LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64,
            speculative={"method": "eagle3", "controller": "fixed"})  # fmt: skip


@pytest.mark.parametrize("topk,steps", [(2, 3), (3, 2)])
def test_eagle3_tree_greedy_equals_plain(tiny_dir, prompts, reference, topk, steps):  # noqa: F811
    """Greedy trees run the speculative step (verify, accept, move KV, grow the next tree on
    the device); the first tree after a prefill comes from the per-sequence proposer."""
    llm = eagle_llm(tiny_dir, topk=topk, num_steps=steps)
    proposer, runner = llm.engine.speculator.proposer, llm.engine.runner
    seen_trees = []
    propose, run_spec = proposer.propose, runner.run_spec
    tree_steps = []

    def spy(reqs, k):
        out = propose(reqs, k)
        seen_trees.extend(d for d in out if d.num_nodes)
        return out

    def spy_step(batch, k, k_draft):
        out = run_spec(batch, k, k_draft)
        tree_steps.append(out)
        seen_trees.extend(d for d in out.next_drafts if d.num_nodes)
        return out

    proposer.propose, runner.run_spec = spy, spy_step
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert len(tree_steps) >= 5 and any(max(o.num_accepted) > 0 for o in tree_steps)
    assert seen_trees and any(not d.is_chain for d in seen_trees)
    for d in seen_trees:
        assert d.num_nodes <= K and all(p < i for i, p in enumerate(d.parents))
        # at most topk children per node, root included
        for parent in [-1, *range(d.num_nodes)]:
            assert d.parents.count(parent) <= topk
    assert llm.engine.speculator.stats.num_verify_steps > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_trees_grown_in_the_step_equal_the_per_sequence_proposer(tiny_dir, prompts):  # noqa: F811
    """The step grows each next tree on the device from the accepted path; the per-sequence
    proposer (speculative/eagle3_tree.py) grows it from its frontier. From the same context
    they must pick the same tree."""
    trees: list[dict] = [{}, {}]
    for i, stepped in enumerate((True, False)):
        llm = eagle_llm(tiny_dir, topk=2, num_steps=3)
        engine = llm.engine
        if not stepped:
            engine.speculator.verify_per_sequence()
        reqs = [
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=24)) for p in prompts
        ]
        order = {r.request_id: j for j, r in enumerate(reqs)}
        if stepped:
            run_spec = engine.runner.run_spec

            def spy(batch, k, k_draft, run_spec=run_spec, seen=trees[i], order=order):
                out = run_spec(batch, k, k_draft)
                for s, a, d in zip(batch.seqs, out.num_accepted, out.next_drafts):
                    seen[(order[s.request.request_id], s.start_pos + 1 + a)] = d
                return out

            engine.runner.run_spec = spy
        else:
            propose = engine.speculator.proposer.propose

            def spy(reqs, k, propose=propose, seen=trees[i], order=order):
                out = propose(reqs, k)
                for r, d in zip(reqs, out):
                    if d.num_nodes:
                        seen[(order[r.request_id], r.num_computed_tokens)] = d
                return out

            engine.speculator.proposer.propose = spy
        while engine.has_unfinished():
            engine.step()
    common = trees[0].keys() & trees[1].keys()
    assert len(common) >= 10, (len(trees[0]), len(trees[1]))
    same = [
        (trees[0][c].token_ids, trees[0][c].parents) == (trees[1][c].token_ids, trees[1][c].parents)
        for c in common
    ]
    # Equal up to float rounding in near-ties (the two paths batch differently): 175 of 175 here.
    assert sum(same) >= 0.95 * len(same), f"{sum(same)} of {len(same)} trees equal"


def test_eagle3_tree_code_with_topk_1_equals_the_chain(tiny_dir, prompts):  # noqa: F811
    """The tree path (masks, slots, positions, gathers) run with topk 1 must draft exactly
    the chain the chain path drafts."""
    from outrider.speculative.eagle3_tree import propose_trees

    llm = eagle_llm(tiny_dir)
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    # The per-sequence path (what trees take) keeps the frontier the tree code starts from.
    engine.speculator.verify_per_sequence()
    reqs = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30)) for p in prompts[:4]
    ]
    compared = 0
    for _ in range(6):
        engine.step()
        live = [r for r in reqs if r.drafts and r.num_computed_tokens == r.num_tokens - 1]
        if not live:
            continue
        proposer.num_steps = K
        fronts = [proposer._frontier[r.request_id] for r in live]
        trees = propose_trees(proposer, live, fronts, K)
        proposer.num_steps = None
        for r, tree in zip(live, trees):
            assert tree.token_ids == r.drafts.token_ids and tree.is_chain
            compared += 1
    assert compared >= 4


def test_engines_and_graph_runners_free_without_the_cycle_collector(tiny_dir):  # noqa: F811
    """GPU memory of an engine goes back when its last reference goes: no reference cycle may
    hold a model, a KV pool or a graph runner until gc runs (seen on CUDA: a second LLM in the
    same process found its memory budget taken)."""
    import gc
    import weakref

    from outrider.executor.cuda_graph import GraphRunner
    from outrider.executor.drafter import _chain_step
    from outrider.layers.attn_backends.base import get_backend

    gc.disable()
    try:
        llm = eagle_llm(tiny_dir)
        proposer = llm.engine.speculator.proposer
        runners = [
            GraphRunner(llm.engine.runner.model, get_backend("torch_ref", "cpu"), 4, 0, 16),
            GraphRunner(
                proposer.draft, get_backend("torch_ref", "cpu"), 4, 0, 16,
                step=_chain_step(proposer.draft), extra_widths={"hidden": (128, torch.float32)},
            ),
        ]  # fmt: skip
        refs = [weakref.ref(x) for x in (llm.engine, proposer, *runners)]
        del llm, proposer, runners
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


@pytest.mark.slow
def test_sampled_requests_draw_drafts_from_the_distribution_they_report(tiny_dir, prompts):  # noqa: F811
    """A request that samples gets drafts drawn from the draft's own distribution under its
    temperature / top-p, and that distribution is what goes to rejection sampling: the first
    draft's frequencies over many proposals match the reported row (chi-squared), and every
    draft has positive probability in its row."""
    from tests.unit.test_spec_verify import chi2_pvalue

    llm = eagle_llm(tiny_dir, random_drafter(_target(tiny_dir), seed=3))
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    req = engine.add_request(prompts[1], SamplingParams(temperature=1.5, top_p=0.95, max_tokens=30))
    engine.step()  # prefill: the frontier is ready
    assert req.num_computed_tokens == req.num_tokens - 1
    counts: dict[int, int] = {}
    q = None
    for _ in range(3000):
        d = proposer.propose([req], K)[0]
        assert d.draft_probs is not None and d.draft_probs.shape == (K, 512)
        rows = d.draft_probs[torch.arange(K), torch.tensor(d.token_ids)]
        assert bool((rows > 0).all())
        q = d.draft_probs[0] if q is None else q
        assert torch.equal(d.draft_probs[0], q)  # same state, same first distribution
        counts[d.token_ids[0]] = counts.get(d.token_ids[0], 0) + 1
    torch.testing.assert_close(q.sum(), torch.tensor(1.0))
    obs = torch.zeros(512)
    for t, n in counts.items():
        obs[t] = n
    assert int((q * 3000 >= 5).sum()) >= 5  # enough well-filled cells for the test to bite
    assert chi2_pvalue(obs, q) > 0.001
    greedy = engine.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=10))
    engine.step()
    assert proposer.propose([greedy], K)[0].draft_probs is None  # greedy: deterministic drafts


def _target(tiny_dir):  # noqa: F811
    from outrider.loaders.checkpoint import open_checkpoint

    return open_checkpoint(str(tiny_dir[0])).config


@pytest.mark.parametrize(
    "options",
    [
        {"num_blocks": 14, "block_size": 8, "enable_prefix_caching": False},  # preemption
        {"num_blocks": 64, "block_size": 8},  # prefix hits reuse the draft KV of cached blocks
        {"max_num_batched_tokens": 7},  # chunked prefill: an extend per chunk
    ],
)
def test_eagle3_under_preemption_prefix_hits_and_chunking(tiny_dir, prompts, reference, options):  # noqa: F811
    llm = eagle_llm(tiny_dir, **options)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    again = llm.generate(prompts[:3], GREEDY)  # the second time some prefixes are cached
    assert [o.token_ids for o in again] == reference[:3]
    engine = llm.engine
    assert engine.speculator.stats.num_verify_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if options.get("num_blocks") == 14:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("topk,steps", [(1, None), (3, 4)])
def test_steps_wider_than_a_kv_block_stay_inside_the_pool(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    reference,  # noqa: F811
    topk,
    steps,
):
    """12 drafts per row with 8-token blocks: a verify holds 13 tokens, so the masked rows of a
    short or padded row spill past one block; they must still write inside the scratch block
    (writing past it ran off the end of the pool, or over another request's KV on a GPU)."""
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, block_size=8,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 12},
    )  # fmt: skip
    engine = llm.engine
    drafter = Eagle3Drafter(random_drafter(engine.checkpoint.config), engine.runner, topk, steps)
    engine.speculator.use_proposer(drafter)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.speculator.stats.num_verify_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_server_warm_up_speculates_unseen_by_the_controller(tiny_dir):  # noqa: F811
    """outrider serve's warm-up drafts and verifies (the drafter's catch-up and the speculative
    step compile there on a GPU) at a fixed k, so the adaptive controller keeps its start-up
    state, and the speculator's counters start afresh."""
    from outrider.server.engine_load import warm_up

    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256,
        speculative={"method": "ngram", "controller": "adaptive", "num_draft_tokens": K},
    )  # fmt: skip
    engine = llm.engine
    spec = engine.speculator
    spec.use_proposer(Eagle3Drafter(random_drafter(engine.checkpoint.config), engine.runner))
    controller = spec.controller
    assert controller is not None
    seen = []
    reset = spec.reset_stats
    spec.reset_stats = lambda: seen.append(spec.stats.num_verify_steps) or reset()
    warm_up(engine)
    assert seen and seen[0] > 0  # speculative steps verified drafts
    assert spec.controller is controller and spec.stats.num_verify_steps == 0
    assert not spec.steps_by_k and not controller._global and not controller._live
    assert not engine.has_unfinished()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
