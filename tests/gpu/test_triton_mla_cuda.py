"""MLA on CUDA: the Triton latent-attention kernel == TorchRefBackend at DeepSeek-V3 / Kimi-K2
ranks (r 512, d_r 64; 64 and 128 heads a rank), and a tiny DeepSeek-V3 whose decode and
n-gram verify steps replay CUDA graphs (no eager forward in steady state) with the greedy
output of the same model run eagerly. The CPU suite (tests/unit/test_triton_mla.py) checks
the kernel's logic on small shapes."""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.test_triton_mla import BRANCHY, build_mla_case, compare_mla

pytestmark = pytest.mark.gpu

# fp32 runs IEEE dot products; bf16 rounds P before P @ V, as every fast kernel does.
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
DTYPES = [torch.bfloat16, torch.float32]
DT_IDS = ["bf16", "fp32"]


def _check(res: dict, dtype: torch.dtype) -> None:
    assert res["finite"], res
    assert res["max_err"] < TOL[dtype], res
    assert res["cache_err"] == 0.0, res
    assert res["padded_max"] == 0.0, res


def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("heads", [64, 128])
def test_decode_real_ranks(dtype, heads):
    # 32 sequences of 1..4K keys, two padded rows (seq_len 0).
    lens = _lens(32, 1, 4096, seed=heads)
    lens[3] = lens[20] = 0
    case = build_mla_case(lens, [1] * 32, heads, 512, 64, dtype=dtype, device="cuda")
    for num_splits in (None, 1, 5):
        _check(compare_mla(case, num_splits), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_decode_long_context_splits(dtype):
    case = build_mla_case([1, 9000, 32768], [1] * 3, 128, 512, 64, dtype=dtype, device="cuda")
    res = compare_mla(case)
    _check(res, dtype)
    assert res["splits"][0] > 1, res


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("k", [1, 4])
def test_verify_chain_real_ranks(dtype, heads, k):
    lens = _lens(16, k + 1, 6000, seed=k)
    lens[7] = 0  # a padded sequence
    qlens = [1 if n == 0 else 1 + k for n in lens]
    case = build_mla_case(lens, qlens, heads, 512, 64, dtype=dtype, device="cuda")
    for num_splits in (None, 1, 4):
        _check(compare_mla(case, num_splits), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_tree_verify_real_ranks(dtype):
    tree = [-1, -1, -1, 0, 0, 1, 3, 3]
    case = build_mla_case(
        [4100, 9, 700, 3000], [9, 9, 6, 1], 128, 512, 64, trees={0: tree, 1: tree, 2: BRANCHY},
        dtype=dtype, device="cuda",
    )  # fmt: skip
    for num_splits in (None, 1, 3):
        _check(compare_mla(case, num_splits), dtype)


# -- a model through CUDA graphs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ds3(tmp_path_factory):
    from tests.unit.test_deepseek_v3 import _hf_config, _hf_model, _save_tokenizer

    # d_r 16: the rope part's dot product at tl.dot's minimum, as the real models' 64 take it.
    path = tmp_path_factory.mktemp("tiny-ds3-cuda")
    config = _hf_config(q_lora_rank=48, qk_rope_head_dim=16)
    _hf_model(config).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return str(path)


def _run(path: str, dtype: str, cuda_graphs: bool, spec: dict | None):
    """Greedy tokens of 3 prompts, the eager target forwards counted once every prompt is
    prefilled (module hooks run only outside graph replays), the steps that took, the verify
    steps, and the LLM."""
    from outrider import LLM, SamplingParams

    # Sizes that keep every step's shapes the same with and without graphs, so that outputs
    # are equal bit for bit even in bf16 (no GEMM sees another row count): graphs for batches
    # 1, 2 and 3 only, so no batch is padded, and max_model_len 128, under which every split-K
    # choice is 1 however long the graph runner takes a context to be.
    llm = LLM(
        path, dtype=dtype, device="cuda", max_model_len=128, num_blocks=64,
        cuda_graphs=cuda_graphs, cuda_graph_max_batch=3, speculative=spec,
    )  # fmt: skip
    runner = llm.engine.runner
    assert runner.backend.name == "triton" and runner.model.graph_safe
    prompts = [list(range(5, 14)), list(range(30, 45)), list(range(40, 46)) * 4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = llm.engine
    calls = [0]
    handle = runner.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        reqs = [engine.add_request(p, params) for p in prompts]
        while not all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            engine.step()
        calls[0], steps = 0, 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        handle.remove()
    tokens = [r.output_token_ids for r in reqs]
    verifies = engine.speculator.stats.num_verify_steps if spec else 0
    return tokens, calls[0], steps, verifies, llm


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_deepseek_v3_decode_and_verify_replay_graphs(tiny_ds3, dtype, spec):
    spec_cfg = None
    if spec:
        spec_cfg = {"method": spec, "controller": "fixed", "num_draft_tokens": 3}
    tokens, eager, steps, verifies, llm = _run(tiny_ds3, dtype, True, spec_cfg)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.graphs
    if spec:
        assert runner.spec_step.graphs and verifies > 0
    assert steps >= 5
    assert eager == 0, f"{eager} eager forwards in {steps} steady-state steps"
    del llm, runner
    want, eager_calls, _, _, _ = _run(tiny_ds3, dtype, False, spec_cfg)
    assert eager_calls > 0  # the same count sees eager forwards
    assert tokens == want
