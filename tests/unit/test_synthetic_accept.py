"""Synthetic acceptance through the engine on a tiny random model: acceptance follows the curve,
output stays plain greedy, the random EAGLE-3 drafter runs for its cost, and the benchmark
script writes its result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import Request
from outrider.executor.drafter import Eagle3Drafter
from outrider.speculative.base import DeviceDrafter
from outrider.testing.synthetic import SyntheticProposer, measured_curve, parse_curve
from outrider.testing.synthetic_drafter import SyntheticDrafter
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (fixture)
from tests.unit.test_spec_eagle3 import random_drafter

K = 4
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes on shared cores: a second thread only adds contention."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (4 + 3 * i,), generator=g).tolist() for i in range(16)]


@pytest.fixture(scope="module")
def llm(tiny_dir):  # noqa: F811
    spec = {"method": "ngram", "controller": "fixed", "num_draft_tokens": K}
    return LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, speculative=spec)


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):  # noqa: F811
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256)
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def _run(llm, proposer, prompts):
    speculator = llm.engine.speculator
    speculator.use_proposer(proposer)
    speculator.reset_stats()
    outs = llm.generate(prompts, PARAMS)
    return [o.token_ids for o in outs], speculator.stats


def test_proposer_draws_follow_the_curve():
    cont = list(range(10, 200))
    prop = SyntheticProposer({(1, 2): cont}, [0.9, 0.5], vocab_size=512, seed=3)
    req = Request(prompt_token_ids=[1, 2], params=PARAMS)
    hits = [0, 0, 0]
    for _ in range(4000):
        d = prop.propose([req], 3)[0].token_ids
        assert len(d) == 3 and all(0 <= t < 512 for t in d)
        run = next((j for j, t in enumerate(d) if t != cont[j]), 3)
        assert all(t == (cont[j] + 1) % 512 for j, t in enumerate(d) if j >= run)
        for j in range(run):
            hits[j] += 1
    a1, a2, a3 = hits[0] / 4000, hits[1] / hits[0], hits[2] / hits[1]
    assert abs(a1 - 0.9) < 0.02 and abs(a2 - 0.5) < 0.03 and abs(a3 - 0.5) < 0.04
    assert prop.counts.on_continuation == 12000 and not prop.counts.diverged_requests
    # Seeded by the prompt: a request forgotten and seen again draws the same again.
    prop.forget(req.request_id)
    again = SyntheticProposer({(1, 2): cont}, [0.9, 0.5], vocab_size=512, seed=3)
    assert [again.propose([req], 3)[0].token_ids for _ in range(20)] == [
        prop.propose([req], 3)[0].token_ids for _ in range(20)
    ]


def test_a_diverged_request_drafts_from_the_transition_table():
    # Plain runs whose next token follows from the current one: 7 -> 8 -> 9 -> 7 ..., and a
    # second prompt whose run passes 5 -> 6. The request's output flips to 8 where its
    # continuation said 9: drafts then follow the table from 8, not the stale continuation.
    cont = [8, 9, 7, 8, 9, 7, 8, 9]
    prop = SyntheticProposer({(1, 7): cont, (3, 5): [6, 7, 8]}, [1.0], vocab_size=512)
    req = Request(prompt_token_ids=[1, 7], params=PARAMS)
    assert prop.propose([req], 3)[0].token_ids == [8, 9, 7]  # on its continuation
    req.output_token_ids.extend([8, 8])  # the second token left it (9 expected)
    assert prop.propose([req], 3)[0].token_ids == [9, 7, 8]
    assert prop.counts.diverged_requests == [req.request_id]
    assert prop.counts.off_continuation == 3 and prop.counts.on_continuation == 3
    # A token no plain run went past ends the chain there.
    lone = SyntheticProposer({(1, 2): [3, 4]}, [1.0], vocab_size=512)
    req = Request(prompt_token_ids=[1, 2], params=PARAMS)
    req.output_token_ids.extend([3, 3])
    assert lone.propose([req], 3)[0].token_ids == [4]


def test_curve_parsing_and_measured_curve():
    assert parse_curve("0.8") == (0.8,) and parse_curve("0.9/0.7") == (0.9, 0.7)
    for bad in ("1.5", "x", "0.9/"):
        with pytest.raises(ValueError, match="curve"):
            parse_curve(bad)
    assert measured_curve([50, 25, 0, 0], 100) == [0.5, 0.5, 0.0]


def test_unknown_prompt_is_refused():
    prop = SyntheticProposer({(1,): [5]}, [0.5], vocab_size=8)
    with pytest.raises(KeyError, match="run it plainly first"):
        prop.propose([Request(prompt_token_ids=[3], params=PARAMS)], 2)


@pytest.mark.parametrize("rate", [1.0, 0.0, 0.5])
def test_engine_acceptance_follows_curve_and_stays_lossless(llm, prompts, plain, rate):
    cont = {tuple(p): o for p, o in zip(prompts, plain)}
    prop = SyntheticProposer(cont, [rate], vocab_size=512, seed=1)
    outs, stats = _run(llm, prop, prompts)
    assert outs == plain  # lossless: greedy output whatever the drafts
    assert prop.counts.off_continuation == 0
    first = (
        stats.accepted_per_position[0] / stats.num_verify_steps
        if stats.accepted_per_position
        else 0
    )
    if rate == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    elif rate == 0.0:
        assert stats.num_verify_steps > 0 and stats.num_accepted_tokens == 0
    else:
        assert stats.num_verify_steps >= 200
        assert abs(first - 0.5) < 0.1
        curve = measured_curve(stats.accepted_per_position, stats.num_verify_steps)
        assert all(abs(a - 0.5) < 0.15 for a in curve[:2])


def test_cost_drafter_runs_the_network_and_stays_lossless(llm, prompts, plain):
    target = llm.engine.checkpoint.config
    drafter = Eagle3Drafter(random_drafter(target), llm.engine.runner)
    calls = []
    drafter.draft.register_forward_hook(lambda *_: calls.append(1))
    cont = {tuple(p): o for p, o in zip(prompts, plain)}
    prop = SyntheticProposer(cont, [0.8], vocab_size=512, seed=2)
    wrapper = SyntheticDrafter(drafter, prop)
    assert isinstance(wrapper, DeviceDrafter)
    outs, stats = _run(llm, wrapper, prompts)
    assert outs == plain
    # The draft network ran at every speculative step (catch-up + K - 1 chain steps each).
    assert len(calls) >= stats.num_verify_steps // len(prompts) * K
    first = stats.accepted_per_position[0] / stats.num_verify_steps
    assert 0.6 < first < 0.95  # the synthetic drafts, not the random drafter's, were verified


def test_cost_drafter_under_async_scheduling_stays_lossless(tiny_dir, prompts, plain):  # noqa: F811
    """Its drafts come from the host (the step hands back none), so no speculative step can be
    launched on the step before's drafts: each is read first, and the output stays plain."""
    spec = {"method": "ngram", "controller": "fixed", "num_draft_tokens": K}
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=256, speculative=spec,
              async_scheduling=True)  # fmt: skip
    drafter = Eagle3Drafter(random_drafter(llm.engine.checkpoint.config), llm.engine.runner)
    cont = {tuple(p): o for p, o in zip(prompts, plain)}
    wrapper = SyntheticDrafter(drafter, SyntheticProposer(cont, [0.8], vocab_size=512, seed=2))
    outs, stats = _run(llm, wrapper, prompts[:6])
    assert outs == plain[:6] and stats.num_accepted_tokens > 0
    assert llm.engine.num_steps_run_ahead == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "moe-tiny"])
def test_benchmark_smoke_writes_result(tmp_path, model):
    """The tiny Llama and the tiny DeepSeek-V3 (MLA, routed experts, its residual writes
    scaled down as the Llama shapes')."""
    out = tmp_path / "synthetic.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/synthetic_accept.py"), "--smoke",
           "--model", model, "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"command", "commit", "machine", "versions"} <= res.keys()
    rows = res["rows"]
    assert len(rows) == len(res["curves"]) * len(res["concurrency"])
    for row in rows:
        for key in ("curve", "concurrency", "k", "accept_length", "target_accept_length",
                    "tok_per_s", "plain_tok_per_s", "speedup", "predicted_speedup",
                    "predicted_speedup_at_measured", "ratio"):  # fmt: skip
            assert key in row, key
        assert row["lossless"] is True
        assert row["speedup"] > 0 and row["ratio"] > 0
    one = [r for r in rows if r["curve"] == [1.0]]
    assert one and all(r["accept_length"] > 1 for r in one)
