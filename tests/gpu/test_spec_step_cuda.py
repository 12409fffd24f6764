"""The speculative step on CUDA in steady state: no eager model forward (target or drafter)
and one device->host read per step, for n-gram and EAGLE-3 chains and EAGLE-3 trees at several
batch sizes; and fp32 greedy output equal to plain decoding at each of them."""

from __future__ import annotations

import warnings

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, HELDOUT
from outrider.transfer import HostCopy

pytestmark = pytest.mark.gpu


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    texts = (GROUNDED + HELDOUT) * 8
    return [
        llm.encode_chat_text(llm.apply_chat_template([{"role": "user", "content": p}], True))
        for p in texts[:n]
    ]


def _count_steady_state(llm: LLM, prompts, params) -> tuple[int, list[int], int]:
    """Step until every request is decoding, then count eager forwards (module hooks run only
    outside graph replays) and synchronizing calls per step until one request finishes."""
    engine = llm.engine
    calls = [0]

    def hook(*_):
        calls[0] += 1

    handles = [engine.runner.model.register_forward_pre_hook(hook)]
    drafter = engine.runner.drafter
    if drafter is not None:
        handles.append(drafter.draft.register_forward_pre_hook(hook))
    reqs = [engine.add_request(p, params) for p in prompts]
    for _ in range(200):  # every prompt prefilled, then one more step to draft after it
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            break
        engine.step()
    engine.step()
    calls[0] = 0
    syncs, steps = [], 0
    # A read through transfer.HostCopy waits on an event, which the sync debug mode does not
    # report: counted here beside what it reports. (StagedUpload's event wait, before it
    # reuses its host buffer, is no read: the copy it waits for was queued a step before.)
    waits = [0]
    wait = HostCopy.wait

    def counted(self):
        waits[0] += 1
        return wait(self)

    HostCopy.wait = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while not any(r.is_finished for r in reqs) and steps < 20:
            waits[0] = 0
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                engine.step()
            syncs.append(sum("synchroniz" in str(w.message) for w in seen) + waits[0])
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
        HostCopy.wait = wait
        for h in handles:
            h.remove()
    while engine.has_unfinished():
        engine.step()
    return calls[0], syncs, steps


TREE = {"num_draft_tokens": 8, "topk": 3, "num_steps": 4}


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3_tree"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_steady_state_replays_graphs_and_reads_the_host_once(drafter_path, method, concurrency):
    spec = {"method": method, "num_draft_tokens": 4, "controller": "fixed"}
    if method.startswith("eagle3"):
        spec.update(method="eagle3", draft=drafter_path)
    if method == "eagle3_tree":
        spec.update(TREE)
    llm = LLM(dtype="bfloat16", device="cuda", num_blocks=1024, speculative=spec)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    prompts = _prompts(llm, concurrency)
    if method == "ngram":  # drafts for every row: n-gram finds none in some rows otherwise
        prompts = [p * 3 for p in prompts]
    eager, syncs, steps = _count_steady_state(llm, prompts, params)
    assert steps >= 5
    assert eager == 0, f"{eager} eager forwards in {steps} steady-state steps"
    assert syncs and max(syncs) == 1, syncs


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_spec_step_greedy_equals_plain_fp32(drafter_path, concurrency):
    plain = LLM(dtype="float32", device="cuda", num_blocks=1024)
    prompts = _prompts(plain, concurrency)
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    for spec in (
        {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"},
        {"method": "eagle3", "draft": drafter_path, "num_draft_tokens": 4, "controller": "fixed"},
        {"method": "eagle3", "draft": drafter_path, "controller": "fixed", **TREE},
    ):
        llm = LLM(dtype="float32", device="cuda", num_blocks=1024, speculative=spec)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert got == want, spec
        assert llm.engine.runner.spec_step.graphs
        assert llm.engine.speculator.stats.num_verify_steps > 0
        del llm
