"""Scheduler, driven by a fake runner that keeps a paged "KV cache" of token ids.

The fake runner writes each computed token into (block, offset) through the batch's block
tables and reads the whole context back before sampling, so a wrong block table, a shared block
overwritten, or a bad recompute after preemption shows up as a wrong context or a wrong output.
"""

from __future__ import annotations

import pytest

from outrider.config import SchedulerConfig
from outrider.core import (
    FinishReason,
    ForwardMode,
    Request,
    RequestStatus,
    SamplingParams,
    ScheduledBatch,
    StepOutput,
)
from outrider.engine.block_manager import BlockManager
from outrider.engine.scheduler import Scheduler

BS = 4


class Sim:
    """A scheduler plus a fake runner keeping a paged "KV cache" of token ids: each computed
    token is written at (block, offset) through the batch's block table, and the whole context
    is read back before sampling a token that depends on all of it."""

    def __init__(
        self,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        budget: int = 64,
        chunked: bool = True,
        prefix: bool = True,
        long_prefill: int | None = None,
        max_long: int = 1,
    ) -> None:
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill,
            max_long_partial_prefills=max_long,
        )
        self.bm = BlockManager(num_blocks, BS, prefix)
        self.sched = Scheduler(config, self.bm, max_model_len=1024)
        self.kv: dict[tuple[int, int], int] = {}

    def add(self, tokens: list[int], request_id: str) -> Request:
        req = Request(prompt_token_ids=list(tokens), params=SamplingParams(), request_id=request_id)
        self.sched.add_request(req)
        return req

    def forward(self, batch: ScheduledBatch) -> StepOutput:
        ids, tokens = [], []
        for seq in batch.seqs:
            req = seq.request
            assert seq.token_ids == req.all_token_ids[seq.start_pos : seq.context_len]
            for j, tok in enumerate(seq.token_ids):
                pos = seq.start_pos + j
                block = seq.block_ids[pos // BS]
                assert not self.bm.cache.is_cached(block), f"write into shared block {block}"
                self.kv[block, pos % BS] = tok
            ctx = [self.kv[seq.block_ids[p // BS], p % BS] for p in range(seq.context_len)]
            assert ctx == req.all_token_ids[: seq.context_len], f"{req.request_id} reads bad KV"
            if seq.sample:
                ids.append(req.request_id)
                tokens.append([sum((i + 1) * t for i, t in enumerate(ctx)) % 997])
        return StepOutput(request_ids=ids, token_ids=tokens)

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        self.sched.postprocess(batch, self.forward(batch))
        return batch

    def run(self, max_tokens: int, check=None, max_steps: int = 10_000) -> list[ScheduledBatch]:
        """Step until every request has finished at max_tokens output tokens."""
        batches = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return batches
            before = list(self.sched.running)
            batch = self.sched.schedule()
            if check is not None:
                check(batch, before)
            batches.append(batch)
            self.sched.postprocess(batch, self.forward(batch))
            for seq in batch.seqs:
                if seq.sample and len(seq.request.output_token_ids) >= max_tokens:
                    self.sched.finish(seq.request, FinishReason.LENGTH)
            self.bm.check_invariants()
        raise AssertionError(f"not finished after {max_steps} steps")

    def outputs(self, prompts: list[list[int]], max_tokens: int, check=None) -> dict:
        reqs = [self.add(p, f"r{i}") for i, p in enumerate(prompts)]
        self.run(max_tokens, check)
        assert all(r.status == RequestStatus.FINISHED for r in reqs)
        return {r.request_id: r.output_token_ids for r in reqs}


def ids(batch: ScheduledBatch) -> list[str]:
    return [s.request.request_id for s in batch.seqs]


PROMPTS = [[(7 * i + j) % 50 for j in range(5 + 3 * i)] for i in range(6)]


def test_budget_and_max_num_seqs_hold_every_step():
    sim = Sim(max_num_seqs=3, budget=10)

    def check(batch: ScheduledBatch, before: list[Request]) -> None:
        assert 0 < batch.num_tokens <= 10
        assert len(batch.seqs) <= 3 and sim.sched.num_running <= 3

    sim.outputs(PROMPTS, max_tokens=4, check=check)
    assert sim.bm.num_free_blocks == 64


def test_chunked_prefill_splits_a_long_prompt():
    sim = Sim(budget=8)
    req = sim.add(list(range(100, 120)), "long")
    batches = sim.run(max_tokens=2)
    chunks = [(b.seqs[0].start_pos, b.seqs[0].token_ids, b.seqs[0].sample) for b in batches]
    prompt = req.prompt_token_ids
    assert chunks[:3] == [
        (0, prompt[0:8], False),
        (8, prompt[8:16], False),
        (16, prompt[16:], True),
    ]
    assert chunks[3:] == [(20, [req.output_token_ids[0]], True)]
    assert [b.mode for b in batches] == [ForwardMode.PREFILL] * 3 + [ForwardMode.DECODE]


def test_decodes_and_prefill_chunks_share_a_step():
    sim = Sim(budget=8)
    sim.add(list(range(6)), "a")
    sim.step()
    sim.add(list(range(50, 63)), "b")
    batch = sim.step()
    assert [(s.request.request_id, s.query_len, s.sample) for s in batch.seqs] == [
        ("a", 1, True),
        ("b", 7, False),  # what the budget has left after a's decode
    ]
    assert batch.mode == ForwardMode.PREFILL
    assert sim.step().mode == ForwardMode.PREFILL  # b's last 6 prompt tokens
    assert sim.step().mode == ForwardMode.DECODE


def chunks(batch: ScheduledBatch) -> dict[str, tuple[int, int]]:
    """{request id: (start, end)} of what each sequence computes this step."""
    return {s.request.request_id: (s.start_pos, s.context_len) for s in batch.seqs}


def test_the_docstring_example():
    sim = Sim(budget=8, long_prefill=4)
    sim.add([1, 2], "A")
    long = sim.add(list(range(100, 140)), "L")
    steps = [chunks(sim.step()) for _ in range(2)]
    sim.add([3, 4, 5], "S")
    steps += [chunks(sim.step()) for _ in range(8)]
    assert steps[:4] == [
        {"A": (0, 2), "L": (0, 4)},
        {"A": (2, 3), "L": (4, 8)},
        {"A": (3, 4), "S": (0, 3), "L": (8, 12)},
        {"A": (4, 5), "S": (3, 4), "L": (12, 16)},
    ]
    assert [s["L"] for s in steps[4:]] == [(p, p + 4) for p in range(16, 40, 4)]
    assert len(long.output_token_ids) == 1


def test_without_a_threshold_the_short_request_waits_behind_the_long_prompt():
    sim = Sim(budget=8, long_prefill=0)
    sim.add([1, 2], "A")
    sim.add(list(range(100, 140)), "L")
    steps = [chunks(sim.step()) for _ in range(2)]
    short = sim.add([3, 4, 5], "S")
    steps += [chunks(sim.step()) for _ in range(5)]
    assert [s["L"] for s in steps] == [
        (0, 6),
        *((p, p + 7) for p in range(6, 34, 7)),
        (34, 40),
        (40, 41),
    ]
    assert [s.get("S") for s in steps[2:]] == [None, None, None, (0, 1), (1, 3)]
    assert len(short.output_token_ids) == 1  # sampled in step 7


@pytest.mark.parametrize("num_short", [6, 12])
def test_short_requests_during_a_long_prefill_get_first_tokens_within_two_steps(num_short):
    budget, threshold = 32, 8
    sim = Sim(num_blocks=256, budget=budget, long_prefill=threshold, max_num_seqs=16)
    long = sim.add([(3 * j) % 97 for j in range(300)], "long")
    for _ in range(3):
        sim.step()
    assert long.num_computed_tokens == 3 * threshold  # alone, a threshold-sized chunk a step
    shorts = [sim.add([i % 50, 60, 61, 62][: 3 + i % 2], f"s{i}") for i in range(num_short)]
    steps = 0
    while sim.sched.has_unfinished():
        before = long.num_computed_tokens
        batch = sim.step()
        steps += 1
        assert 0 < batch.num_tokens <= budget
        if long.num_prompt_tokens - before > threshold:
            assert long.num_computed_tokens - before <= threshold
        if steps == 2:
            assert all(s.output_token_ids for s in shorts)  # first tokens within 2 steps
            assert long.num_computed_tokens > before  # and the long prompt goes on beside them
        for req in [long, *shorts]:
            if len(req.output_token_ids) >= 4 and not req.is_finished:
                sim.sched.finish(req, FinishReason.LENGTH)
        sim.bm.check_invariants()
        assert steps < 200
    assert all(len(r.output_token_ids) == 4 for r in [long, *shorts])
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_one_long_prompt_advances_at_a_time_and_short_ones_pass_the_queued_one():
    sim = Sim(budget=16, long_prefill=4, max_num_seqs=8)
    first = sim.add(list(range(100, 130)), "first")
    second = sim.add(list(range(200, 230)), "second")
    sim.add([5, 6, 7], "short")
    batch = sim.step()
    assert chunks(batch) == {"short": (0, 3), "first": (0, 4)}  # second waits, short passes it
    assert list(sim.sched.waiting) == [second] and second.block_ids == []
    while first.num_tokens - first.num_computed_tokens > 4:
        assert "second" not in chunks(sim.step())
    batch = sim.step()  # first's last 4 tokens are short now: second starts beside them
    assert chunks(batch)["first"] == (28, 30) and chunks(batch)["second"] == (0, 4)
    two = Sim(budget=16, long_prefill=4, max_long=2)
    two.add(list(range(100, 130)), "first")
    two.add(list(range(200, 230)), "second")
    assert chunks(two.step()) == {"first": (0, 4), "second": (0, 4)}


def test_a_long_prompt_shorter_than_the_one_in_flight_takes_its_turn():
    sim = Sim(budget=16, long_prefill=4)
    big = sim.add(list(range(100, 140)), "big")
    assert chunks(sim.step()) == {"big": (0, 4)}
    sim.add(list(range(200, 210)), "medium")  # 10 tokens: long, but 26 fewer than big's
    assert chunks(sim.step()) == {"medium": (0, 4)}  # big keeps its KV and waits
    assert big.status == RequestStatus.RUNNING and len(big.block_ids) == 1
    assert chunks(sim.step()) == {"medium": (4, 8)}
    assert chunks(sim.step()) == {"medium": (8, 10), "big": (4, 8)}  # 2 left: a short prompt


@pytest.mark.parametrize("max_drafts, want", [(None, (8, 10)), (2, (8, 11))])
def test_decodes_and_verifies_take_the_budget_before_an_earlier_prompt(max_drafts, want):
    from outrider.core import SeqDrafts

    sim = Sim(budget=6, long_prefill=4)
    prompt = sim.add(list(range(100, 111)), "prompt")  # admitted first
    a = sim.add([1, 2], "a")
    assert chunks(sim.step()) == {"a": (0, 2), "prompt": (0, 4)}
    assert chunks(sim.step()) == {"a": (2, 3), "prompt": (4, 8)}
    a.drafts = SeqDrafts.chain([9, 9, 9])
    batch = sim.sched.schedule(max_drafts=max_drafts)  # prompt: 3 left, no longer long
    k = 3 if max_drafts is None else max_drafts
    assert chunks(batch) == {"prompt": want, "a": (3, 4 + k)}  # a verifies, the prompt waits
    assert prompt.status == RequestStatus.RUNNING


def test_max_num_seqs_keeps_later_requests_waiting():
    sim = Sim(max_num_seqs=2)
    reqs = [sim.add([i] * 3, f"r{i}") for i in range(3)]
    assert ids(sim.step()) == ["r0", "r1"]
    assert sim.sched.num_waiting == 1 and reqs[2].status == RequestStatus.WAITING
    assert ids(sim.step()) == ["r0", "r1"]
    sim.sched.finish(reqs[0], FinishReason.STOP)
    assert ids(sim.step()) == ["r1", "r2"]


@pytest.mark.parametrize("long_prefill", [0, 4])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_in_a_tiny_pool_finishes_everything_with_the_same_outputs(
    chunked, prefix, long_prefill
):
    def check(batch: ScheduledBatch, before: list[Request]) -> None:
        # A step that preempts admits nothing: memory is short, admitting would thrash.
        if batch.preempted:
            assert all(s.request in before for s in batch.seqs)
            assert all(r.status == RequestStatus.WAITING for r in batch.preempted)

    roomy = Sim(chunked=chunked, prefix=prefix).outputs(PROMPTS, max_tokens=12)
    sim = Sim(num_blocks=10, budget=32, chunked=chunked, prefix=prefix, long_prefill=long_prefill)
    tiny = sim.outputs(PROMPTS, max_tokens=12, check=check)
    assert sim.sched.num_preemptions > 0
    assert tiny == roomy  # recompute after preemption is exact
    assert sim.bm.num_free_blocks == 10
    assert not sim.sched.has_unfinished()


def test_a_prompt_chunk_cut_to_one_token_is_not_a_verify():
    """A request still computing its prompt whose chunk the budget cuts to one token holds no
    drafts of this position (any it has were made before a preemption): it is a prompt chunk,
    and the decode after it verifies its own drafts. Taken for a verify, the stale drafts were
    accepted as the target's tokens (greedy output diverged under preemption)."""
    from outrider.core import SeqDrafts

    sim = Sim(budget=6)
    p = sim.add(list(range(100, 112)), "p")  # admitted first: its chunks take what decodes leave
    a = sim.add([1, 2], "a")
    sim.step()
    assert chunks(sim.step()) == {"a": (2, 3), "p": (4, 9)}
    a.drafts = SeqDrafts.chain([9, 9, 9, 9])  # a's verify takes 5 of the 6: p's chunk gets 1
    p.drafts = SeqDrafts.chain([7, 7, 7])
    batch = sim.sched.schedule()
    assert chunks(batch) == {"p": (9, 10), "a": (3, 8)}
    by_id = {s.request.request_id: s for s in batch.seqs}
    assert by_id["p"].drafts is None and by_id["a"].drafts.token_ids == [9, 9, 9, 9]


def test_preempted_request_goes_first_and_recomputes_prompt_and_outputs():
    sim = Sim(num_blocks=4, prefix=False)
    a, b = sim.add([1] * 5, "a"), sim.add([2] * 5, "b")  # 2 blocks each: the pool is full
    for _ in range(4):  # prefill, then 3 decodes: 8 tokens computed each, blocks full
        sim.step()
    late = sim.add([3] * 2, "late")
    batch = sim.step()  # a needs a 3rd block: b, the latest admitted, is preempted
    assert batch.preempted == [b] and ids(batch) == ["a"]
    assert b.status == RequestStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.drafts is None  # drafted after a token it now recomputes as a prompt
    assert b.metrics.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert list(sim.sched.waiting) == [b, late]
    assert len(b.output_token_ids) == 4  # kept across preemption
    sim.sched.finish(a, FinishReason.STOP)
    seq = sim.step().seqs[0]
    assert seq.request is b
    assert (seq.start_pos, seq.token_ids, seq.sample) == (0, b.all_token_ids[:9], True)
    assert len(b.output_token_ids) == 5


def test_repeated_prompt_skips_cached_prefill():
    sim = Sim()
    prompt = list(range(30, 43))  # 13 tokens: 3 full blocks
    first = sim.add(prompt, "first")
    sim.run(max_tokens=3)
    again = sim.add(prompt, "again")
    seq = sim.step().seqs[0]
    assert (seq.start_pos, seq.token_ids) == (12, prompt[12:])
    assert again.metrics.num_cached_tokens == 12 and first.metrics.num_cached_tokens == 0
    assert again.metrics.first_scheduled_time is not None
    assert sim.bm.stats.hit_tokens == 12
    assert again.output_token_ids == first.output_token_ids[:1]


def test_failed_admission_returns_prefix_references():
    sim = Sim(num_blocks=5)
    prompt = list(range(9))
    sim.add(prompt, "first")
    sim.run(max_tokens=1)  # leaves prompt[:8] cached in 2 evictable blocks
    cached, _ = sim.bm.cache.match(prompt, 2)
    assert len(cached) == 2
    hog = sim.add(list(range(100, 108)), "hog")
    sim.step()  # hog holds 2 blocks; 1 plain free block is left
    big = sim.add(prompt + list(range(200, 208)), "big")  # hits 2, then needs 3 more
    batch = sim.step()  # hog's decode takes the plain free block: big does not fit
    assert ids(batch) == ["hog"]
    assert big.status == RequestStatus.WAITING and big.block_ids == []
    assert big.num_computed_tokens == 0
    assert [sim.bm.ref_count(b) for b in cached] == [0, 0]
    assert sim.bm.num_free_blocks == 2
    sim.sched.finish(hog, FinishReason.STOP)
    sim.run(max_tokens=2)
    assert big.metrics.num_cached_tokens == 8
    assert sim.bm.num_free_blocks == 5


def test_abort_frees_blocks_and_unknown_ids_return_none():
    sim = Sim(num_blocks=8)
    a = sim.add(list(range(9)), "a")
    sim.step()
    b = sim.add(list(range(5)), "b")
    assert sim.sched.abort("a") is a
    assert a.status == RequestStatus.FINISHED and a.finish_reason == FinishReason.ABORT
    assert a.block_ids == [] and sim.bm.num_free_blocks == 8
    assert sim.sched.abort("b") is b  # still waiting
    assert sim.sched.abort("missing") is None
    assert not sim.sched.has_unfinished() and sim.sched.schedule().is_empty
    with pytest.raises(ValueError, match="finished twice"):
        sim.sched.finish(a, FinishReason.STOP)


def test_abort_during_a_step_is_skipped_by_postprocess():
    sim = Sim()
    a, b = sim.add(list(range(9)), "a"), sim.add(list(range(5)), "b")
    batch = sim.sched.schedule()
    output = sim.forward(batch)
    sim.sched.abort("a")  # arrives while the forward runs
    sim.sched.postprocess(batch, output)
    assert a.output_token_ids == [] and a.num_computed_tokens == 0 and a.block_ids == []
    assert len(b.output_token_ids) == 1
    assert ids(sim.step()) == ["b"]


def test_without_chunking_a_long_prompt_waits_for_an_empty_batch():
    sim = Sim(budget=8, chunked=False)
    short = sim.add([1] * 3, "short")
    sim.add(list(range(12)), "long")
    assert ids(sim.step()) == ["short"]
    sim.sched.finish(short, FinishReason.STOP)
    batch = sim.step()  # alone, the over-budget prompt runs whole
    assert [(s.request.request_id, s.query_len) for s in batch.seqs] == [("long", 12)]


def test_impossible_prompt_raises_instead_of_spinning():
    sim = Sim(num_blocks=4)  # 16 positions
    sim.add(list(range(16)), "huge")  # 16 + 1 positions: 5 blocks
    with pytest.raises(RuntimeError, match=r"huge .* needs 5 KV blocks .* pool has 4 blocks"):
        sim.sched.schedule()


@pytest.mark.parametrize("prefix", [True, False])
def test_request_outgrowing_the_pool_raises_instead_of_spinning(prefix):
    sim = Sim(num_blocks=4, budget=4, prefix=prefix)  # 16 positions, chunks of 4
    req = sim.add(list(range(14)), "grows")
    with pytest.raises(RuntimeError, match="grows .* needs 5 KV blocks"):
        sim.run(max_tokens=100, max_steps=100)
    assert len(req.output_token_ids) == 3  # positions 0..15 computed; 16 has no block


def test_postprocess_checks_the_output_matches_the_batch():
    sim = Sim()
    sim.add([1, 2, 3], "a")
    batch = sim.sched.schedule()
    with pytest.raises(ValueError, match="does not match"):
        sim.sched.postprocess(batch, StepOutput(request_ids=["b"], token_ids=[[5]]))
    sim.sched.postprocess(batch, StepOutput(request_ids=["a"], token_ids=[[5]]))
    with pytest.raises(RuntimeError, match="postprocessed twice"):
        sim.sched.postprocess(batch, StepOutput(request_ids=["a"], token_ids=[[5]]))


def test_add_request_validates():
    sim = Sim()
    sim.add([1], "x")
    with pytest.raises(ValueError, match="already queued"):
        sim.add([1], "x")
    with pytest.raises(ValueError, match="empty prompt"):
        sim.add([], "y")
    with pytest.raises(ValueError, match="max_model_len=1024"):
        sim.add([1] * 1024, "z")


def test_prompts_beside_decodes_in_flight_take_only_prompt_work_and_preempt_no_one():
    """schedule_prompts: chunks of running prompts, then waiting ones, from the budget given;
    decodes are left to the step in flight, and a chunk that does not fit waits."""
    sim = Sim(budget=16, num_blocks=12, long_prefill=0)
    sim.add(list(range(6)), "a")
    sim.step()  # a decodes from here on
    sim.add(list(range(50, 70)), "b")  # 20 tokens: chunked
    sim.add(list(range(80, 83)), "c")
    batch = sim.sched.schedule_prompts(8)
    assert chunks(batch) == {"b": (0, 8)} and batch.mode == ForwardMode.PREFILL
    sim.sched.postprocess(batch, sim.forward(batch))
    batch = sim.sched.schedule_prompts(16)
    assert chunks(batch) == {"b": (8, 20), "c": (0, 3)}  # b first: running, mid-prompt
    sim.sched.postprocess(batch, sim.forward(batch))
    assert sim.sched.schedule_prompts(16).is_empty  # only decodes left
    # A pool too short for the waiting prompt: it waits, and nobody running loses blocks.
    held = {r.request_id: list(r.block_ids) for r in sim.sched.running}
    sim.add(list(range(100, 140)), "d")  # 10 blocks; 12 - 2 - 5 - 1 are free
    assert sim.sched.schedule_prompts(64).is_empty
    assert {r.request_id: r.block_ids for r in sim.sched.running} == held
    assert sim.sched.num_waiting == 1 and sim.sched.num_preemptions == 0
