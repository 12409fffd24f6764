"""The real default model through outrider against HF transformers, and the engine's batching,
chunking, caching and preemption keeping outputs identical (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq

pytestmark = pytest.mark.slow


GREEDY64 = SamplingParams(temperature=0, max_tokens=64)


def test_logits_match_hf(llm, hf_model, chat_prompt_ids):
    runner = llm.engine.runner
    ids = chat_prompt_ids[0]
    blocks = runner.num_blocks - 8  # blocks far from what other tests' requests use
    req = Request(prompt_token_ids=ids, params=GREEDY64)
    n_blocks = (len(ids) + 15) // 16
    batch = ScheduledBatch(
        ForwardMode.PREFILL,
        [ScheduledSeq(req, ids, 0, list(range(blocks, blocks + n_blocks)), True)],
    )
    hidden, _, _ = runner.forward(batch)
    with torch.inference_mode():
        got = runner.model.compute_logits(hidden)
        want = hf_model(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-3


def test_greedy_matches_hf_generate(llm, hf_model, chat_prompt_ids):
    outs = llm.generate(chat_prompt_ids[:10], GREEDY64)
    for ids, out in zip(chat_prompt_ids[:10], outs):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=64,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0, len(ids) :].tolist()
        assert out.token_ids == ref, f"diverged for prompt {ids[:8]}..."


def test_batch_invariance(llm, chat_prompt_ids):
    """Each prompt's greedy output alone == inside a batch of 16 mixed-length prompts."""
    prompts = (chat_prompt_ids * 2)[:16]
    # Mixed lengths: trim some prompts to a raw prefix of varied length.
    prompts = [p if i % 3 else p[: 5 + i] for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = llm.generate(prompts, params)
    alone: dict[tuple[int, ...], list[int]] = {}  # prompts 13 and 14 repeat 1 and 2: run once
    for p, b in zip(prompts, batched):
        if tuple(p) not in alone:
            alone[tuple(p)] = llm.generate([p], params)[0].token_ids
        assert alone[tuple(p)] == b.token_ids


def test_prefix_cache_hit_equals_miss(llm, chat_prompt_ids):
    ids = chat_prompt_ids[3]
    params = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate([ids], params)[0]
    second = llm.generate([ids], params)[0]
    assert second.token_ids == first.token_ids
    assert second.metrics["num_cached_tokens"] >= 16 * ((len(ids) - 1) // 16)
    assert second.metrics["num_cached_tokens"] > 0


def test_chunked_prefill_and_preemption_keep_outputs(llm, chat_prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = chat_prompt_ids[:8]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    # Chunks of 8 tokens, no prefix reuse, and a pool too small for all 8 at once.
    small = LLM(
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
        num_blocks=12,
    )
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks
