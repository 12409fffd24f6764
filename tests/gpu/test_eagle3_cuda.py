"""EAGLE-3 on CUDA: greedy output with a drafter (random weights: losslessness does not depend
on its quality) equals plain decoding in fp32, chain and tree, with the target's CUDA graphs
returning the aux streams, also where prompts are prefilled beside speculative steps; the
graphs' aux output equals the eager forward's."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN

pytestmark = pytest.mark.gpu


def _eagle_llm(path: str, topk: int, **options) -> LLM:
    return LLM(
        dtype="float32", device="cuda", gpu_memory_utilization=0.2,
        speculative={"method": "eagle3", "controller": "fixed", "draft": path, "num_draft_tokens": 4, "topk": topk,
                     "num_steps": 3 if topk > 1 else None}, **options,
    )  # fmt: skip


@pytest.mark.parametrize("topk", [1, 3])
def test_eagle3_greedy_equals_plain_on_cuda(drafter_path, topk):
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    spec = _eagle_llm(drafter_path, topk)
    runner = spec.engine.runner
    assert runner.graphs is not None and runner.graphs.aux_layers == runner.aux_layers
    outs = spec.chat(convs, params)
    assert [o.token_ids for o in outs] == want
    assert spec.engine.speculator.stats.num_verify_steps > 0
    # chains and trees run the speculative step's graphs, drafter included
    graphs = runner.spec_step.graphs
    assert graphs and all(draft is not None for _, draft, *_ in graphs.captured.values())
    assert (runner.spec_step.tree is not None) == (topk > 1)


@pytest.mark.parametrize("topk", [1, 3])
def test_prompts_prefilled_beside_graphed_speculative_steps(drafter_path, topk, monkeypatch):
    """Three requests at once with outputs of different lengths: later prompts are prefilled
    while the others speculate in graph-replayed steps: run before such a step (Speculator.
    split) or, chains run ahead, launched beside one (Scheduler.schedule_prompts). Output
    equals plain decoding's (fp32), and every KV block comes back."""
    from outrider.engine.scheduler import Scheduler
    from outrider.engine.speculation import Speculator

    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:4] + OPEN[:4]]
    params = [SamplingParams(temperature=0, max_tokens=12 + 10 * i) for i in range(len(convs))]
    plain = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2, max_num_seqs=3)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    beside = []
    split, schedule_prompts = Speculator.split, Scheduler.schedule_prompts

    def watch_split(self, batch):
        beside.append("split")
        return split(self, batch)

    def watch_prompts(self, budget):
        batch = schedule_prompts(self, budget)
        if batch.seqs:
            beside.append("ahead")
        return batch

    monkeypatch.setattr(Speculator, "split", watch_split)
    monkeypatch.setattr(Scheduler, "schedule_prompts", watch_prompts)
    spec = _eagle_llm(drafter_path, topk, max_num_seqs=3)
    outs = spec.chat(convs, params)
    assert [o.token_ids for o in outs] == want
    assert beside, "no prompt ran beside a speculative step"
    assert spec.engine.speculator.stats.num_verify_steps > len(beside)
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_graph_aux_streams_equal_eager(drafter_path):
    from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq

    spec = _eagle_llm(drafter_path, 1)
    runner = spec.engine.runner
    reqs = [Request(prompt_token_ids=[1, 2, 3], params=SamplingParams()) for _ in range(3)]
    seqs = [ScheduledSeq(r, [5 + i], 20 + i, [i, 7], True) for i, r in enumerate(reqs)]
    batch = ScheduledBatch(ForwardMode.DECODE, seqs)
    graphed, aux_g, _ = runner.forward(batch, runner.aux_layers)
    graphs, runner.graphs = runner.graphs, None
    eager, aux_e, _ = runner.forward(batch, runner.aux_layers)
    runner.graphs = graphs
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(aux_g, -1), torch.cat(aux_e, -1), rtol=1e-4, atol=1e-4)


def test_chain_drafts_from_draft_graphs_equal_eager(drafter_path):
    """Chain steps replayed from DRAFT graphs propose the drafts the eager chain proposes, for
    every step: each replay's outputs are views of the graph's static buffers, so drafts kept
    across steps must be copies (kept views all read the last step's ids)."""
    spec = _eagle_llm(drafter_path, 1)
    engine, proposer = spec.engine, spec.engine.speculator.proposer
    params = SamplingParams(temperature=0, max_tokens=32)
    prompts = [
        spec.encode_chat_text(spec.apply_chat_template([{"role": "user", "content": p}], True))
        for p in GROUNDED[:3] + OPEN[:3]
    ]
    reqs = [engine.add_request(ids, params) for ids in prompts]
    engine.step()  # prefill: the prompts' rows deferred, extended over by propose's catch-up
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in reqs)
    assert all(engine.speculator._reserve_draft_slots(r, 4) for r in reqs)  # as a step would
    graphed = [d.token_ids for d in proposer.propose(reqs, 4)]
    assert proposer._graphs is not None and proposer._graphs.graphs
    proposer._draft_graphs = lambda: None  # the eager chain, same KV slots, same inputs
    eager = [d.token_ids for d in proposer.propose(reqs, 4)]
    assert graphed == eager
    assert any(len(set(ids)) > 1 for ids in eager)  # the drafts vary, so aliasing would show
