"""Seeded sampling, stop conditions and bad input on the real default model."""

from __future__ import annotations

import pytest

from outrider import SamplingParams

pytestmark = pytest.mark.slow


def test_seeded_sampling_is_reproducible(llm, chat_prompt_ids):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    a = llm.generate([chat_prompt_ids[1]], params)[0]
    # Same seed inside a batch, at another row, beside unseeded requests: same tokens.
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batch = llm.generate(
        [chat_prompt_ids[2], chat_prompt_ids[1], chat_prompt_ids[0]], [others, params, others]
    )
    assert batch[1].token_ids == a.token_ids
    c = llm.generate(
        [chat_prompt_ids[1]], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24)
    )[0]
    assert c.token_ids != a.token_ids


def test_max_tokens_and_stop_strings(llm, chat_prompt_ids):
    out = llm.generate(
        [chat_prompt_ids[4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    full = llm.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=40))[0]
    words = full.text.split()
    assert len(words) > 3, full.text
    stop = words[2]
    cut = llm.generate(
        [chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert full.text.startswith(cut.text)


def test_stream_deltas_add_up_to_generate(llm, chat_prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=20)
    whole = llm.generate([chat_prompt_ids[5]], params)[0]
    deltas = list(llm.stream(chat_prompt_ids[5], params))
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((d.token_ids for d in deltas), []) == whole.token_ids
    assert deltas[-1].finished and deltas[-1].metrics["num_generated_tokens"] == len(
        whole.token_ids
    )


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
    )[0]
    assert "Paris" in out.text


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -1}, ["temperature", "-1"]),
        ({"top_p": 0}, ["top_p", "0"]),
        ({"top_p": 1.5}, ["top_p", "1.5"]),
        ({"max_tokens": 0}, ["max_tokens", "0"]),
        ({"max_tokens": -3}, ["max_tokens", "-3"]),
    ],
)
def test_invalid_sampling_values(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert all(w in str(e.value) for w in words)


def test_bad_requests_do_not_disturb_others(llm, chat_prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate([chat_prompt_ids[6]], params)[0]
    too_long = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match="context"):
        llm.generate([chat_prompt_ids[6], too_long], params)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], params)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], params)
    # Nothing half-ran: the engine is idle and still answers the same.
    assert not llm.engine.has_unfinished()
    assert llm.generate([chat_prompt_ids[6]], params)[0].token_ids == before.token_ids


def test_bad_model_paths():
    from outrider import LLM

    with pytest.raises(FileNotFoundError, match="no/such/model.gguf"):
        LLM("no/such/model.gguf")


def test_logprobs_top_n(llm, chat_prompt_ids):
    out = llm.generate(
        [chat_prompt_ids[7]], SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        values = list(entry.values())
        assert all(v <= 0 for v in values)
        # Greedy picks the most likely token: it is first in the top-N order.
        assert next(iter(entry)) == token and values[0] == max(values)
