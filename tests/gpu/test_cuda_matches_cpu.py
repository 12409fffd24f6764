"""On CUDA the engine gives the CPU fp32 reference's greedy output (fp32), and runs in bf16."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Who wrote Romeo and Juliet?",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def cpu_reference():
    llm = LLM(dtype="float32", device="cpu")
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=48))
    return [o.token_ids for o in outs]


def test_fp32_cuda_equals_cpu(cpu_reference):
    llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=48),
    )
    assert [o.token_ids for o in outs] == cpu_reference


def test_bf16_cuda_runs_and_mostly_agrees(cpu_reference):
    llm = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=48),
    )
    assert all(o.token_ids and o.finish_reason in ("stop", "length") for o in outs)
    # bf16 logits are rounded to 8 bits of mantissa (0.125 apart near 25) and this model's top
    # candidates are often closer than that, so near-ties flip; most answers still agree.
    agree = sum(o.token_ids[:8] == ref[:8] for o, ref in zip(outs, cpu_reference))
    assert agree >= len(PROMPTS) // 2, agree
