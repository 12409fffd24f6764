"""Async scheduling on CUDA: greedy output equals stepping one batch at a
time, with CUDA graphs replaying steps launched on device-side token ids."""

from __future__ import annotations

import warnings

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN
from outrider.core import StructuredOutputs

pytestmark = pytest.mark.gpu


def test_async_scheduling_on_cuda_equals_sync():
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:6]]
    params = [SamplingParams(temperature=0, max_tokens=24 + 8 * (i % 4)) for i in range(10)]
    sync = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, async_scheduling=False)
    want = [o.token_ids for o in sync.chat(convs, params)]
    del sync
    llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2)  # on by default
    assert llm.engine._async and llm.engine.runner.graphs is not None
    assert [o.token_ids for o in llm.chat(convs, params)] == want
    assert llm.engine.num_steps_run_ahead > 20
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_plain_steps_of_a_speculating_engine_run_ahead_on_cuda(drafter_path):
    """EAGLE-3 (graphs, fp32) under a controller that alternates plain runs and drafts: the
    plain steps run ahead, their aux streams deferred for the drafter from the launched
    graphs, and greedy output still equals plain decoding's."""
    from tests.unit.test_spec_eagle3 import _ScriptedController

    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, async_scheduling=False)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    spec = LLM(
        dtype="float32", device="cuda", gpu_memory_utilization=0.2,
        speculative={"method": "eagle3", "controller": "fixed", "draft": drafter_path,
                     "num_draft_tokens": 4},
    )  # fmt: skip
    engine = spec.engine
    assert engine._async and engine.runner.graphs is not None
    engine.speculator.controller = _ScriptedController(([0] * 6 + [4] * 3 + [0] * 4 + [2] * 2) * 40)
    assert [o.token_ids for o in spec.chat(convs, params)] == want
    assert engine.num_steps_run_ahead > 10 and engine.speculator.stats.num_verify_steps > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("topk", [1, 3])
def test_speculative_steps_run_ahead_on_cuda(drafter_path, topk):
    """EAGLE-3 chains and trees in graphs (fp32): each speculative step launches the next on
    its own acceptance (a tree's: its accepted path, KV moved, and next tree), still on the
    device, before its read; the output equals the same engine stepping one batch at a time,
    and every block comes back."""
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    params = [SamplingParams(temperature=0, max_tokens=40 + 8 * (i % 3)) for i in range(8)]
    spec = {"method": "eagle3", "controller": "fixed", "draft": drafter_path, "num_draft_tokens": 4,
            "topk": topk, "num_steps": 3 if topk > 1 else None}  # fmt: skip

    def llm(async_scheduling: bool) -> LLM:
        return LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec,
                   async_scheduling=async_scheduling)  # fmt: skip

    sync = llm(False)
    want = [o.token_ids for o in sync.chat(convs, params)]
    del sync
    ahead = llm(True)
    engine = ahead.engine
    assert engine.runner.spec_step.graphs
    assert [o.token_ids for o in ahead.chat(convs, params)] == want
    assert engine.num_steps_run_ahead > 15 and engine.speculator.stats.num_accepted_tokens > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


def test_ngram_steps_run_ahead_on_cuda():
    """N-gram chains in graphs (fp32): the lookup runs inside the step over the tokens every
    forward keeps (executor/token_drafts.py), so each speculative step launches the next
    before its read; the output equals plain decoding's, stepped one batch at a time."""
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    params = [SamplingParams(temperature=0, max_tokens=40 + 8 * (i % 3)) for i in range(8)]
    plain = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, async_scheduling=False)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    spec = {"method": "ngram", "controller": "fixed", "num_draft_tokens": 4}
    ahead = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec)
    engine = ahead.engine
    assert engine.runner.token_pool is not None and engine.runner.spec_step.graphs
    assert [o.token_ids for o in ahead.chat(convs, params)] == want
    stats = engine.speculator.stats
    assert stats.num_verify_steps > 15 and stats.num_accepted_tokens > 0
    assert engine.num_steps_run_ahead > 15
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


def test_sampled_speculative_steps_run_ahead_on_cuda(drafter_path):
    """Unseeded sampled rows run ahead in the graphs, decided between the replays from their
    parameters: at top_k=1 their sampler is the argmax, so they give the greedy tokens."""
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    spec = {"method": "eagle3", "controller": "fixed", "draft": drafter_path, "num_draft_tokens": 4}
    greedy = SamplingParams(temperature=0, max_tokens=40)
    one_hot = SamplingParams(temperature=1.0, top_k=1, max_tokens=40)
    sync = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec,
               async_scheduling=False)  # fmt: skip
    want = [o.token_ids for o in sync.chat(convs, greedy)]
    del sync
    ahead = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec)
    assert [o.token_ids for o in ahead.chat(convs, one_hot)] == want
    engine = ahead.engine
    assert engine.num_steps_run_ahead > 15
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


def test_seeded_and_logprob_rows_run_ahead_on_cuda(drafter_path):
    """Seeded sampled rows (their output positions completed on the device) and rows asking
    for logprobs run ahead in the graphs, and give what stepping one batch at a time gives."""
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    spec = {"method": "eagle3", "controller": "fixed", "draft": drafter_path, "num_draft_tokens": 4}
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=11 + i)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=40, logprobs=2)
        for i in range(8)
    ]

    def run(async_scheduling: bool):
        llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec,
                  async_scheduling=async_scheduling)  # fmt: skip
        outs = [o.outputs[0] for o in llm.chat(convs, params)]
        return llm, outs

    sync, want = run(False)
    del sync
    ahead, got = run(True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for i in range(0, 8, 2):
        for a, b in zip(got[i].logprobs, want[i].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert ahead.engine.num_steps_run_ahead > 15


def test_arrivals_join_speculative_steps_run_ahead_on_cuda(drafter_path):
    """Requests arriving every few steps compute their prompts beside the graphs run ahead and
    join the step after (a finished request's row, or past the others: a larger captured
    batch); the steps keep running ahead, and the output equals stepping one batch at a
    time."""
    from tests.unit.test_async_speculation import _arrive

    texts = GROUNDED[:4] + OPEN[:6]
    spec = {"method": "eagle3", "controller": "fixed", "draft": drafter_path, "num_draft_tokens": 4}

    def params(i):
        if i % 3 == 2:
            return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24 + 4 * i, seed=i)
        return SamplingParams(temperature=0, max_tokens=24 + 4 * i)

    def run(async_scheduling: bool):
        llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, speculative=spec,
                  async_scheduling=async_scheduling)  # fmt: skip
        prompts = [llm.encode_chat([{"role": "user", "content": t}]) for t in texts]
        return llm, _arrive(llm, prompts, params)

    sync, want = run(False)
    del sync
    ahead, got = run(True)
    assert got == want
    engine = ahead.engine
    assert engine.runner.spec_step.graphs
    assert engine.speculator.num_rows_joined >= len(texts) - 3
    steps = sum(engine.speculator.steps_by_k.values())
    assert engine.num_steps_run_ahead >= steps - 8, (engine.num_steps_run_ahead, steps)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine._ahead is None


@pytest.mark.parametrize("masks_ahead", [0, 16])
def test_plain_steps_run_ahead_wait_on_nothing_but_their_reads_on_cuda(masks_ahead, monkeypatch):
    """Plain decode steps run ahead beside greedy constrained rows (picked from their top
    logits, a refused guess computed again in the step after; or, at most masks_ahead of them,
    their masked argmax taken on the device, the masks sent pinned) and requests that finish at
    different steps: a step that launches the next before its read makes the host wait on
    nothing but that read, which waits on an event (a pageable host->device copy, such as an
    index tensor made with torch.as_tensor, would wait for the step in flight: the next one
    would then be launched on an idle device). Steps that run nothing ahead (they read as they
    go) and steps where a grammar refused every top candidate and allowed more than one token
    (a late mask decided from the logits, read at once) are left out: a mask of one token is
    the token, with no read."""
    from outrider.engine import grammar_steps as steps_module

    monkeypatch.setattr(steps_module, "MASKS_AHEAD_MAX_ROWS", masks_ahead)
    llm = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    engine = llm.engine
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"],
        "additionalProperties": False,
    }
    texts = GROUNDED[:3] + OPEN[:5]
    prompts = [
        llm.encode_chat_text(llm.apply_chat_template([{"role": "user", "content": t}], True))
        for t in texts
    ]
    constrained = SamplingParams(
        temperature=0, max_tokens=48, structured_outputs=StructuredOutputs(json=schema)
    )
    reqs = [
        engine.add_request(
            p,
            constrained
            if i % 2
            else SamplingParams(temperature=0, max_tokens=10 + 6 * i, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    for _ in range(100):
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            break
        engine.step()
    counters = engine.grammars.counters
    ahead, late = engine.num_steps_run_ahead, counters.late_masks

    def decided() -> int:  # late rows whose logits were read (a mask of one token is not)
        return counters.late_masks - counters.late_forced

    waited, finished, steps = [], 0, 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished() and steps < 80:
            before = decided(), engine.num_steps_run_ahead
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                finished += sum(o.finished for o in engine.step())
            after = decided(), engine.num_steps_run_ahead
            if after[0] == before[0] and after[1] > before[1]:
                waited += [str(w.message) for w in seen if "synchroniz" in str(w.message)]
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_steps_run_ahead - ahead >= 20, "the steps did not run ahead"
    assert finished >= 3, "too few requests finished inside the window"
    if masks_ahead:
        assert counters.masked_ahead > 0
    else:
        assert counters.picked_rows > 0 and counters.masked_ahead == 0
    assert not waited, waited[:3]
    assert all(r.is_finished for r in reqs)
    print("late masks in the window:", counters.late_masks - late, "forced:", counters.late_forced)


def test_a_read_beside_waits_for_its_own_work_not_the_step_launched_after_it():
    """transfer.beside: a late mask's masked argmax in a step run ahead is read on a side
    stream after the event that marks the step's logits, while the main stream runs the step
    launched since (here a sleep of about a second); on the main stream the same read waits
    for it."""
    from outrider.transfer import beside

    logits = torch.randn(64, 4096, device="cuda")
    done = torch.cuda.Event()
    done.record()
    torch.cuda._sleep(2_000_000_000)  # the step launched ahead
    step_after = torch.cuda.Event()
    step_after.record()
    with beside(done):
        got = logits.argmax(dim=-1).tolist()
    assert not step_after.query(), "the read beside waited for the step launched after it"
    with beside(None):
        want = logits.argmax(dim=-1).tolist()
    assert step_after.query(), "a read on the main stream should wait for it"
    assert got == want
