"""Speculative decoding through the whole engine on a tiny random HF checkpoint: lossless
against plain decoding, oracle acceptance, tree verification with KV moves, stops inside
accepted runs, and KV accounting."""

from __future__ import annotations

import random

import pytest

from outrider import LLM, SamplingParams
from outrider.speculative.base import SeqDrafts
from tests.unit.test_engine_tiny import prompts, reference, tiny_dir  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=20)


class OracleProposer:
    """Drafts the target's own greedy continuation (known from a plain run); optionally as a
    tree with a wrong sibling beside every right node, so accepted nodes are not in node order."""

    name = "oracle"
    on_device = False
    aux_layers: tuple[int, ...] = ()
    writes_kv = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], tree: bool = False):
        self.continuations, self.tree = continuations, tree
        self.topk = 2 if tree else 1

    def positions_needed(self, k):
        return 1 + k

    def right(self, req, max_draft_tokens) -> list[int]:
        """The chain drafted for req: its continuation from where its output stands."""
        full = self.continuations[tuple(req.prompt_token_ids)]
        return full[len(req.output_token_ids) : len(req.output_token_ids) + max_draft_tokens]

    def propose(self, requests, max_draft_tokens):
        out = []
        for req in requests:
            right = self.right(req, max_draft_tokens)
            if not self.tree:
                out.append(SeqDrafts.chain(right))
                continue
            tokens, parents, parent = [], [], -1
            for tok in right:
                tokens += [(tok + 1) % 512, tok]  # wrong sibling first, then the right one
                parents += [parent, parent]
                parent = len(tokens) - 1
            n = max_draft_tokens - max_draft_tokens % 2  # whole (wrong, right) pairs only
            out.append(SeqDrafts(tokens[:n], parents[:n]))
        return out

    def observe(self, batch, output):
        pass

    def forget(self, request_id):
        pass


def _llm(tiny_dir, **kw):  # noqa: F811
    return LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, **kw)


def test_ngram_greedy_equals_plain(tiny_dir, prompts, reference):  # noqa: F811
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4}
    )
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.speculator.stats
    # Random tiny models fall into loops, which n-gram lookup drafts: some drafts are accepted.
    assert stats.num_verify_steps > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("tree", [False, True])
def test_oracle_drafts_are_all_accepted(tiny_dir, prompts, reference, tree):  # noqa: F811
    k = 4
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": k}
    )
    cont = {tuple(p): r for p, r in zip(prompts, reference)}
    llm.engine.speculator.use_proposer(OracleProposer(cont, tree=tree))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    want = [
        o.token_ids for o in _llm(tiny_dir).generate(prompts, params)
    ]  # plain, EOS ignored like the oracle run
    assert [o.token_ids for o in outs] == want
    for o in outs:
        m = o.metrics
        # Every right draft is accepted. In the tree half the nodes are wrong siblings; near
        # max_tokens the engine cuts trees to an odd node count (a trailing wrong sibling),
        # which costs at most one right node over the request.
        if tree:
            assert m["num_accepted_tokens"] >= m["num_draft_tokens"] // 2 - 1
        else:
            assert m["num_accepted_tokens"] == m["num_draft_tokens"]
        # 20 tokens: 1 from the prefill, then 19 over verify steps of up to k + 1 (chain) or
        # k / 2 + 1 (tree) tokens each.
        per_step = (k // 2 if tree else k) + 1
        assert m["num_verify_steps"] == -(-19 // per_step)


def test_oracle_tree_moves_accepted_kv(tiny_dir, prompts):  # noqa: F811
    """With wrong siblings in node order, accepted nodes sit at odd node indices: their KV must
    move into path order, or the next steps would attend to the wrong keys."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in _llm(tiny_dir).generate(prompts, params)]
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 6}
    )
    llm.engine.speculator.use_proposer(
        OracleProposer({tuple(p): r for p, r in zip(prompts, plain)}, tree=True)
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    # 3 right nodes + the bonus per step, fewer in the last steps capped by max_tokens.
    assert all(o.metrics["accept_length"] >= 3.6 for o in outs)


def test_stops_inside_accepted_runs(tiny_dir, prompts, reference):  # noqa: F811
    cont = {tuple(p): r for p, r in zip(prompts, reference)}
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 8}
    )
    llm.engine.speculator.use_proposer(OracleProposer(cont))
    for max_tokens in (1, 2, 5, 9, 13):
        out = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        assert out.token_ids == reference[3][:max_tokens]
    # A stop token id in the middle of an accepted run ends the output right there.
    stop_tok = reference[3][6]
    first = reference[3].index(stop_tok)
    out = llm.generate(
        [prompts[3]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == reference[3][: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_with_drafts_is_reproducible(tiny_dir, prompts):  # noqa: F811
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4}
    )
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=24)
    a = [o.token_ids for o in llm.generate(prompts[:4], params)]
    b = [o.token_ids for o in llm.generate(prompts[:4], params)]
    assert a == b


@pytest.mark.slow
def test_kv_accounting_after_1000_mixed_requests(tiny_dir):  # noqa: F811
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=96, block_size=8,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 3}, max_num_seqs=32,
    )  # fmt: skip
    bm = llm.engine.block_manager
    initial = bm.num_free_blocks
    rng = random.Random(0)
    prompts_ = []
    params = []
    for _ in range(1000):
        n = rng.randint(2, 40)
        # Repetitive prompts make n-gram lookup draft often; some requests sample.
        base = [rng.randrange(3, 512) for _ in range(rng.randint(1, 6))]
        prompts_.append((base * 40)[:n])
        params.append(
            SamplingParams(temperature=0, max_tokens=rng.randint(1, 12))
            if rng.random() < 0.7
            else SamplingParams(temperature=1.0, seed=rng.randrange(100), max_tokens=8)
        )
    for i in range(0, 1000, 100):
        outs = llm.generate(prompts_[i : i + 100], params[i : i + 100])
        assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert llm.engine.speculator.stats.num_verify_steps > 100
    assert bm.num_free_blocks == initial
    assert not llm.engine.has_unfinished()


def _profile(verify_factor: float, sizes=(1, 4), k: int = 4):
    from outrider.speculative.step_profile import StepProfile

    return StepProfile({b: {j: 10.0 * (verify_factor if j else 1.0) for j in range(k + 1)}
                        for b in sizes})  # fmt: skip


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_adaptive_controller_turns_speculation_off_and_on(tiny_dir, prompts, reference, method):  # noqa: F811
    """A slow verify table turns speculation off (every decode step plain, output unchanged); a
    fast one with a drafter that matches turns it back on."""
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 4})
    engine, spec = llm.engine, llm.engine.speculator
    assert spec.controller is not None  # adaptive is the default
    cont = {tuple(p): r for p, r in zip(prompts, reference)}
    if method == "eagle3":
        from outrider.executor.drafter import Eagle3Drafter
        from tests.unit.test_spec_eagle3 import random_drafter

        spec.use_proposer(Eagle3Drafter(random_drafter(engine.checkpoint.config), engine.runner))
    else:
        spec.use_proposer(OracleProposer(cont))
    # 100x plain: a live plain step slowed by a loaded machine must not make it look cheap
    spec.controller.set_profile(_profile(verify_factor=100.0))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert spec.stats.num_verify_steps == 0
    assert all(set(o.metrics["steps_by_k"]) == {0} for o in outs)

    spec.controller.set_profile(_profile(verify_factor=1.0))
    for o in outs:  # forget the acceptance seen while off
        spec.controller.forget(o.request_id)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    if method == "ngram":  # the oracle always matches: the controller keeps k at its best, 4
        assert spec.stats.num_verify_steps > 0
        assert all(o.metrics["steps_by_k"].get(4, 0) > 0 for o in outs)
        # What the log says as the engine stops: steps by k, acceptance, the live costs.
        said = spec.summary()
        assert f"k=4: {spec.steps_by_k[4]}" in said and "100% of" in said
        bucket, row = next(iter(spec.controller.live_table().items()))
        k, ms = next(iter(row.items()))
        name = f"k{k}" if isinstance(k, int) else k  # or a step with prompts: mixed, alone
        assert f"{bucket}: {name} {ms:.2f}" in said and "so speculation pays" in said


def test_adaptive_controller_counts_the_host_work_of_a_step(tiny_dir, prompts, reference):  # noqa: F811
    """The start-up profile times the runner alone; a proposer that matches every token but
    costs 200 ms of host time per lookup must still lose to plain decoding once the controller
    has timed a whole step, and it does after at most one step per batch-size bucket (the host
    work one k showed is assumed for the others)."""
    import time

    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 4})
    engine = llm.engine
    oracle = OracleProposer({tuple(p): r for p, r in zip(prompts, reference)})
    propose = oracle.propose

    def slow(requests, k):
        time.sleep(0.2)
        return propose(requests, k)

    oracle.propose = slow
    spec = engine.speculator
    spec.use_proposer(oracle)
    spec.controller.set_profile(_profile(verify_factor=1.0))  # the runner: verify as cheap
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    speculative = sum(n for k, n in spec.steps_by_k.items() if k)
    assert 1 <= speculative <= 2, spec.steps_by_k  # one per batch-size bucket at most
    assert spec.steps_by_k[0] >= 10


def test_adaptive_controller_measures_a_profile_at_start(tiny_dir):  # noqa: F811
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 3})
    profile = llm.engine.speculator.controller.profile
    assert set(profile.ks) == {0, 1, 2, 3}
    assert all(t > 0 for row in profile.ms.values() for t in row.values())


def test_start_up_profile_says_so_at_the_default_level(tiny_dir, caplog):  # noqa: F811
    """Timing the steps takes seconds on a CPU: shown without -v, before and after."""
    import logging

    with caplog.at_level(logging.WARNING, logger="outrider.engine.speculation"):
        llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 3})
    sizes = ", ".join(map(str, llm.engine.runner.profile_batch_sizes()))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    start = [m for m in lines if m.startswith("timing speculative steps")]
    assert start == [f"timing speculative steps at k=0..3 and batch sizes {sizes} to choose "
                     "draft lengths (seconds on a CPU)"], lines  # fmt: skip
    done = [m for m in lines if m.startswith("timed speculative steps in ")]
    assert len(done) == 1 and done[0].endswith(" s"), lines
    assert lines.index(start[0]) < lines.index(done[0])


def test_profiled_steps_spread_their_tokens_over_the_vocabulary(tiny_dir):  # noqa: F811
    """An MoE model routes by token: rows all holding one token would all read the same
    experts, where a real batch reads many."""
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 3})
    runner, seen = llm.engine.runner, []
    run_spec = runner.run_spec

    def spy(batch, k, k_draft):
        seen.extend(t for s in batch.seqs for t in s.token_ids)
        return run_spec(batch, k, k_draft)

    runner.run_spec = spy
    runner.profile_steps((3,), batch_sizes=(4,), reps=2)
    assert len(seen) == 2 * 4 * (1 + 3)  # two rounds eagerly (no warm-up), 4 rows of 1 + 3
    step = seen[: 4 * (1 + 3)]
    assert len(set(step)) > len(step) // 2
    assert all(0 <= t < llm.engine.vocab_size for t in seen)


def test_step_profile_kept_between_starts(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """The second engine of the same shapes reads the profile the first measured; another k, or
    OUTRIDER_STEP_PROFILES=off, measures; a damaged file stops the start with its path."""
    from outrider.executor.model_runner import ModelRunner

    monkeypatch.setenv("OUTRIDER_STEP_PROFILES", str(tmp_path))
    spec = {"method": "ngram", "num_draft_tokens": 2}
    first = _llm(tiny_dir, speculative=spec).engine.speculator.controller.profile
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "profile_steps", refuse)
        again = _llm(tiny_dir, speculative=spec).engine.speculator.controller.profile
    assert again.ms == first.ms and again.key == first.key
    _llm(tiny_dir, speculative={**spec, "num_draft_tokens": 3})  # another key: measured
    assert len(list(tmp_path.glob("*.json"))) == 2
    monkeypatch.setenv("OUTRIDER_STEP_PROFILES", "off")
    with pytest.raises(AssertionError, match="measured again"), monkeypatch.context() as m:
        m.setattr(ModelRunner, "profile_steps", refuse)
        _llm(tiny_dir, speculative=spec)
    monkeypatch.setenv("OUTRIDER_STEP_PROFILES", str(tmp_path))
    files[0].write_text("{not json")
    with pytest.raises(ValueError, match=str(files[0].name)):
        _llm(tiny_dir, speculative=spec)


def test_profile_times_every_shape_in_each_round(tiny_dir):  # noqa: F811
    """Rounds over all shapes, not one shape's steps back to back: a busy spell on a shared
    machine slows every shape alike instead of inflating the k measured during it."""
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 2})
    runner, order = llm.engine.runner, []
    run, run_spec = runner.run, runner.run_spec
    runner.run = lambda batch: (order.append((len(batch.seqs), 0)), run(batch))[1]
    runner.run_spec = lambda b, k, kd: (order.append((len(b.seqs), k)), run_spec(b, k, kd))[1]
    table = runner.profile_steps((2,), batch_sizes=(1, 2), reps=3)
    one_round = [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert order == one_round * 3
    assert sorted(table) == [1, 2] and all(sorted(row) == [0, 2] for row in table.values())


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
@pytest.mark.parametrize("num_blocks", [14, 64])
def test_speculative_step_lossless_under_chunking_preemption_prefix_hits(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    reference,  # noqa: F811
    method,
    num_blocks,
):
    """24 requests (each prompt three times) with a 16-token budget (chunked prefill), batches
    of 1 to 16, through a pool too small for them (14 blocks: preemption) or one that keeps
    prompts cached (64: prefix-cache hits): greedy output equals the reference every time."""
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=num_blocks, block_size=8,
        max_num_batched_tokens=16, max_num_seqs=16,
        speculative={"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
    )  # fmt: skip
    engine = llm.engine
    if method == "eagle3":
        from outrider.executor.drafter import Eagle3Drafter
        from tests.unit.test_spec_eagle3 import random_drafter

        engine.speculator.use_proposer(
            Eagle3Drafter(random_drafter(engine.checkpoint.config), engine.runner)
        )
    outs = llm.generate(prompts * 3, GREEDY)
    assert [o.token_ids for o in outs] == reference * 3
    if num_blocks == 14:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert sum(o.metrics["num_cached_tokens"] for o in outs) > 0
    assert engine.speculator.stats.num_verify_steps > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_under_speculation_equal_plain(tiny_dir, prompts, reference):  # noqa: F811
    """Requests asking for logprobs speculate too: every accepted draft gets its logprob (and
    the top-N) from the verify row that predicted it, equal to what plain decoding reports."""
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    plain = _llm(tiny_dir).generate(prompts[:4], params)
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 4,
                                      "controller": "fixed"})  # fmt: skip
    cont = {tuple(p): o.token_ids for p, o in zip(prompts[:4], plain)}
    llm.engine.speculator.use_proposer(OracleProposer(cont))
    outs = llm.generate(prompts[:4], params)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    for o, want in zip(outs, plain):
        assert o.token_ids == want.token_ids
        assert len(o.logprobs) == len(want.logprobs) == len(o.token_ids)
        for got, ref in zip(o.logprobs, want.logprobs):
            assert list(got) == list(ref)
            assert all(abs(got[t] - ref[t]) < 1e-4 for t in ref)


def test_sampled_rows_in_the_speculative_step_stay_seeded_and_in_vocab(tiny_dir, prompts):  # noqa: F811
    """Sampled, penalised and min_tokens rows beside greedy ones in one speculative step: the
    greedy rows still equal plain decoding, and seeded sampled rows repeat exactly."""
    greedy = SamplingParams(temperature=0, max_tokens=16)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=5,
                             presence_penalty=0.5, min_tokens=4)  # fmt: skip
    want = [o.token_ids for o in _llm(tiny_dir).generate(prompts[:3], greedy)]
    runs = []
    for _ in range(2):
        llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 4,
                                          "controller": "fixed"})  # fmt: skip
        outs = llm.generate(prompts[:3] + prompts[3:6], [greedy] * 3 + [sampled] * 3)
        assert [o.token_ids for o in outs[:3]] == want
        assert all(len(o.token_ids) >= 4 for o in outs[3:])
        runs.append([o.token_ids for o in outs[3:]])
        assert llm.engine.speculator.stats.num_verify_steps > 0
    assert runs[0] == runs[1]


def test_a_cpu_start_up_profile_keeps_the_steps_its_blas_makes_cheaper(tiny_dir):  # noqa: F811
    """On a CPU a verify of more drafts can cost less (the BLAS runs 2-3 rows as GEMVs): the
    table the controller starts from is the one measured, not raised to a running max."""
    llm = _llm(tiny_dir, speculative={"method": "ngram", "num_draft_tokens": 4})
    spec, runner = llm.engine.speculator, llm.engine.runner
    measured = {1: {0: 50.0, 1: 90.0, 2: 120.0, 3: 80.0, 4: 85.0},
                4: {0: 75.0, 1: 85.0, 2: 90.0, 3: 95.0, 4: 100.0}}  # fmt: skip
    runner.profile_steps = lambda ks, sizes: measured
    profile = spec._measure_profile()
    assert profile.ms == measured
    assert profile.step_ms(1, 4) < profile.step_ms(1, 2)
