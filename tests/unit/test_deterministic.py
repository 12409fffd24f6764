"""The deterministic mode on the CPU (ModelConfig.deterministic; layers/batch_invariant.py):
its flags and errors, and, on a tiny random checkpoint in bfloat16, the engine's outputs being
the same bits whatever the batch: greedy speculative (chain and tree drafts) equals plain,
batched equals alone, chunked prefill equals whole, a prefix-cache hit equals a miss. The
Triton kernels' own row invariance is checked under the interpreter in
test_deterministic_kernels.py, at real shapes on a GPU in tests/gpu/test_deterministic_cuda.py.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.config import EngineConfig, ModelConfig
from outrider.core import ForwardMode
from outrider.flags import HelpFormatter, add_engine_flags, engine_config
from outrider.layers import batch_invariant
from outrider.layers.attn_backends.base import get_backend
from outrider.layers.forward_context import AttentionMetadata
from outrider.models.deterministic import make_batch_invariant
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)
from tests.unit.test_spec_engine import OracleProposer

GREEDY = SamplingParams(temperature=0, max_tokens=24)

# -- flags and config -----------------------------------------------------------------------


def _parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_engine_flags(p)
    return engine_config(p.parse_args(list(argv)))


def test_flag_alias_and_yaml_key():
    assert ModelConfig().deterministic is False
    assert _parse().model.deterministic is False
    assert _parse("--deterministic").model.deterministic is True
    assert _parse("--enable-deterministic-inference").model.deterministic is True
    assert _parse("--no-deterministic").model.deterministic is False
    assert EngineConfig.from_dict({"deterministic": True}).model.deterministic is True
    assert EngineConfig.from_dict({"enable-deterministic-inference": True}).model.deterministic
    assert EngineConfig.from_dict({"model": {"deterministic": True}}).model.deterministic


def test_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="deterministic=True with tensor_parallel_size=2"):
        EngineConfig().replace(model={"deterministic": True}, parallel={"tensor_parallel_size": 2})


def test_triton_backend_refuses_splits_and_plans_trees():
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="num_splits=4 with deterministic=True"):
        get_backend("triton", "cuda").__class__(num_splits=4, deterministic=True)
    backend = get_backend("triton", "cuda", deterministic=True)
    assert backend.deterministic and backend.deterministic_trees
    meta = AttentionMetadata(
        ForwardMode.VERIFY, torch.zeros(3, dtype=torch.long), torch.tensor([0, 3]),
        torch.tensor([8]), torch.zeros(1, 1, dtype=torch.int32), [3], [8],
        tree_mask=torch.ones(3, 3, dtype=torch.bool),
    )  # fmt: skip
    backend.prepare(meta)  # a tree verify runs the chunked kernels (test_deterministic_kernels)
    assert not backend._plan(meta).decode


def test_moe_model_is_refused():
    from outrider.layers.moe import GroupedTopkRouter

    model = torch.nn.Sequential(torch.nn.Identity())
    model.router = GroupedTopkRouter.__new__(GroupedTopkRouter)  # its type is what is refused
    torch.nn.Module.__init__(model.router)
    with pytest.raises(ValueError, match="GroupedTopkRouter .*serve this model with"):
        make_batch_invariant(model)


# -- the CPU forms: one row alone equals the row inside any batch -----------------------------


def test_linear_rows_are_invariant_in_bf16():
    torch.manual_seed(0)
    w = torch.randn(96, 320, dtype=torch.bfloat16)
    x = torch.randn(37, 320, dtype=torch.bfloat16)
    full = batch_invariant.linear(x, w)
    for i in (0, 5, 36):
        assert torch.equal(batch_invariant.linear(x[i : i + 1], w), full[i : i + 1])
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-1)


def test_rms_norm_rows_are_invariant():
    from outrider.layers.norm import RMSNorm

    norm = RMSNorm(160).to(torch.bfloat16)
    norm.weight.data.normal_(1.0, 0.1)
    x, res = torch.randn(2, 11, 160, dtype=torch.bfloat16)
    plain = norm(x, res)
    norm.use_batch_invariant()
    out, new_res = norm(x, res)
    torch.testing.assert_close(out, plain[0])
    assert torch.equal(new_res, plain[1])
    one, one_res = norm(x[4:5], res[4:5])
    assert torch.equal(one, out[4:5]) and torch.equal(one_res, new_res[4:5])


# -- the engine -----------------------------------------------------------------------------


class NoisyOracle(OracleProposer):
    """Drafts the plain run's continuation with one token in every `every` wrong, so verifies
    accept some drafts and reject the rest at many positions; as a tree, a wrong sibling
    precedes each right node (accepted nodes are then not in node order)."""

    name = "noisy-oracle"
    every = 3

    def right(self, req, max_draft_tokens) -> list[int]:
        done = len(req.output_token_ids)
        return [
            (t + 7) % 512 if (done + i) % self.every == 2 else t
            for i, t in enumerate(super().right(req, max_draft_tokens))
        ]


def _llm(tiny_dir, **kw):  # noqa: F811
    return LLM(
        str(tiny_dir[0]), dtype="bfloat16", device="cpu", num_blocks=256, deterministic=True, **kw
    )


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):  # noqa: F811
    """Each prompt's deterministic bf16 greedy output, generated alone, with prefix caching
    off (no prompt meets another's KV)."""
    llm = _llm(tiny_dir, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_batched_chunked_and_cached_equal_alone(tiny_dir, prompts, plain):  # noqa: F811
    llm = _llm(tiny_dir)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    # Every prompt met again: its prefix comes from the cache, the rest is computed.
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    chunked = _llm(tiny_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == plain


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_equals_plain_in_bf16(tiny_dir, prompts, plain, tree):  # noqa: F811
    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4}
    )
    continuations = {tuple(p): out for p, out in zip(prompts, plain)}
    llm.engine.speculator.use_proposer(NoisyOracle(continuations, tree=tree))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 10
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_default_mode_keeps_its_kernels(tiny_dir):  # noqa: F811
    """deterministic=False builds exactly today's layers: the default GEMM (F.linear, in its
    faster form for few rows on the CPU: layers/cpu_gemm.py), the usual norms and backend; only
    deterministic=True switches them."""
    from outrider.layers import cpu_gemm
    from outrider.layers.linear import _Linear
    from outrider.layers.norm import RMSNorm

    for deterministic in (False, True):
        llm = LLM(str(tiny_dir[0]), device="cpu", num_blocks=32, deterministic=deterministic)
        runner = llm.engine.runner
        linears = [m for m in runner.model.modules() if isinstance(m, _Linear)]
        norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
        want = batch_invariant.linear if deterministic else cpu_gemm.linear
        assert linears and all(m.gemm is want for m in linears)
        assert runner.model.lm_head.gemm is want
        assert norms and all(m.row_invariant is deterministic for m in norms)
        assert runner.backend.deterministic is deterministic


@pytest.mark.slow
@pytest.mark.parametrize("topk,steps", [(1, None), (2, 2)])
def test_eagle3_equals_plain_in_bf16(tiny_dir, prompts, plain, topk, steps):  # noqa: F811
    """A (random) EAGLE-3 drafter with its default kernels, as build_eagle3_drafter leaves it
    (drafts never decide the output): its drafts, which may change with the batch, ride chain
    and tree verifies, and the output stays plain's."""
    from outrider.executor.drafter import Eagle3Drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    llm = _llm(
        tiny_dir, speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 3}
    )
    engine = llm.engine
    draft = random_drafter(engine.checkpoint.config).to(torch.bfloat16)
    engine.speculator.use_proposer(Eagle3Drafter(draft, engine.runner, topk, steps))
    assert [o.token_ids for o in llm.generate(prompts[:4], GREEDY)] == plain[:4]
    assert engine.speculator.stats.num_verify_steps > 0
