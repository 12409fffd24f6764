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
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name the largest planet in our solar system.",
    "Write one sentence about autumn.",
    "What does a thermometer measure?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in five words.",
    "What language is spoken in Brazil?",
    "Who painted the Mona Lisa?",
    "What is the opposite of cold?",
    "Tell me a fun fact about octopuses.",
]
NEAR_TIE = 0.5  # nats between the fp32 reference's top two candidates


@pytest.fixture(scope="module")
def cpu_reference():
    llm = LLM(dtype="float32", device="cpu")
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=48, logprobs=2))
    return outs


def test_fp32_cuda_equals_cpu(cpu_reference):
    llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=48),
    )
    assert [o.token_ids for o in outs] == [r.token_ids for r in cpu_reference]


def _agrees(ids: list[int], ref) -> bool:
    """The same greedy tokens as the fp32 reference, or the same up to a point where the
    reference itself saw a near-tie (its top two candidates < NEAR_TIE nats apart) and bf16
    picked the other one of the two."""
    for i, (tok, want) in enumerate(zip(ids, ref.token_ids)):
        if tok != want:
            top = ref.logprobs[i]
            return tok in top and top[want] - top[tok] < NEAR_TIE
    return len(ids) == len(ref.token_ids)


def test_bf16_cuda_agrees_with_fp32_cpu(cpu_reference):
    llm = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=48),
    )
    assert all(o.token_ids and o.finish_reason in ("stop", "length") for o in outs)
    exact = sum(o.token_ids == ref.token_ids for o, ref in zip(outs, cpu_reference))
    agree = sum(_agrees(o.token_ids, ref) for o, ref in zip(outs, cpu_reference))
    print(f"bf16 vs fp32: {exact}/{len(PROMPTS)} identical, {agree} identical up to a near-tie")
    assert agree >= 0.9 * len(PROMPTS), (exact, agree)
