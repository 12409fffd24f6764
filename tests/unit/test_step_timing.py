"""The dummy rows the engine times its steps on (executor/step_timing.py) route through an MoE
model as a served batch does: each row in blocks of its own, so no row attends to another's
KV and every row's hidden state, hence its experts, stays its own."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.executor import step_timing
from outrider.layers.moe import GroupedTopkRouter
from outrider.plan.costmodel import unique_experts
from tests.unit.test_deepseek_v3 import _hf_config, _hf_model, _save_tokenizer

EXPERTS, TOP_K, ROWS = 64, 6, 16


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.plan.calibrate import build_runner

    path = tmp_path_factory.mktemp("ds3-64-experts")
    config = _hf_config(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1,
                        topk_group=1, q_lora_rank=None)  # fmt: skip
    _hf_model(config).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return build_runner(open_checkpoint(path), "cpu", "float32", (0, 1))


@pytest.mark.parametrize("k", [0, 1])
def test_dummy_rows_read_the_experts_a_served_batch_reads(runner, k):
    batch = step_timing._dummy_batch(runner, random.Random(0), ROWS, k)
    tables = [tuple(s.block_ids) for s in batch.seqs]
    assert len(set(tables)) == ROWS  # blocks of their own
    assert runner.num_blocks not in {b for t in tables for b in t}  # not the scratch block
    chosen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda m, args, out: chosen.append(out[1][:, :TOP_K]))
        for m in runner.model.modules()
        if isinstance(m, GroupedTopkRouter)
    ]
    try:
        runner.run(batch) if k == 0 else runner.run_spec(batch, k, 0)
    finally:
        for h in hooks:
            h.remove()
    assert chosen
    # Uniform routing's expectation for the step's tokens, less the skew of this model's
    # score-correction bias: 39 of 64 experts a layer at k = 0 (51 expected), where rows
    # sharing one block's KV read 8.
    want = unique_experts(EXPERTS, TOP_K, ROWS * (1 + k))
    for ids in chosen:
        assert len(set(ids.flatten().tolist())) >= 0.6 * want
