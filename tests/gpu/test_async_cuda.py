"""Async scheduling on CUDA: greedy output equals stepping one batch at a
time, with CUDA graphs replaying steps launched on device-side token ids."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN

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
