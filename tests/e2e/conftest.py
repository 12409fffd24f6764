"""The real default model (SmolLM2-135M-Instruct, fp32 on CPU), loaded once per session, and
HF transformers' reference model from the same GGUF file."""

from __future__ import annotations

import pytest
import torch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "Rewrite this sentence in the passive voice: The dog chased the ball.",
    "Summarize: The quick brown fox jumps over the lazy dog. It was a sunny day.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="session")
def llm():
    from outrider import LLM

    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    from outrider.loaders.checkpoint import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompt_ids(llm):
    return [
        llm.encode_chat_text(llm.apply_chat_template([{"role": "user", "content": p}]))
        for p in CHAT_PROMPTS
    ]
