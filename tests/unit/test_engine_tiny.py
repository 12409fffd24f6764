"""The whole engine on a tiny random HF checkpoint (safetensors directory): greedy output equals
HF transformers, and batching, chunked prefill, prefix caching and preemption change nothing."""

from __future__ import annotations

import json

import pytest
import torch

from outrider import LLM, SamplingParams
from tests.tiny import hf_reference, tiny_hf_config

GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny-llama")
    ref = hf_reference(tiny_hf_config("LlamaForCausalLM"))
    ref.save_pretrained(path, safe_serialization=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return path, ref


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    lengths = [3, 9, 17, 30, 41, 5, 64, 12]
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_dir, prompts):
    _, ref = tiny_dir
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            out = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
            )
        outs.append(out[0, len(ids) :].tolist())
    return outs


def test_greedy_equals_hf_alone_and_batched(tiny_dir, prompts, reference):
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=128)
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == reference
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert alone == reference


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 7},  # every prompt prefilled in chunks of <= 7 tokens
        {"num_blocks": 12, "block_size": 8, "enable_prefix_caching": False},  # forces preemption
        {"max_num_seqs": 2, "block_size": 4},
        # long prompts 4 tokens a step, after the short ones; or in admission order
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 4},
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 0},
        {
            "long_prefill_token_threshold": 8,
            "max_long_partial_prefills": 3,
            "num_blocks": 12,
            "block_size": 8,
            "enable_prefix_caching": False,
        },
    ],
)
def test_scheduling_choices_keep_outputs(tiny_dir, prompts, reference, options):
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", **options)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block came back
    if options.get("num_blocks") == 12:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("threshold", [4, 0])
def test_short_requests_arriving_during_a_long_prefill(tiny_dir, prompts, reference, threshold):
    """The 64-token prompt prefills while the others arrive: with a threshold they sample their
    first tokens in the next steps (the 5-token prompt is long too, but shorter: it goes first),
    without one they wait for its prefill; outputs are the same either way."""
    llm = LLM(
        str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=128,
        max_num_batched_tokens=8, long_prefill_token_threshold=threshold,
    )  # fmt: skip
    engine = llm.engine
    long = engine.add_request(prompts[6], GREEDY)
    engine.step()
    shorts = [engine.add_request(prompts[i], GREEDY) for i in (0, 5)]  # 3 and 5 tokens
    first_token_step = [None, None]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        for i, r in enumerate(shorts):
            if r.output_token_ids and first_token_step[i] is None:
                first_token_step[i] = steps
        steps += 1
    assert first_token_step == ([0, 1] if threshold else [7, 8])
    assert [r.output_token_ids for r in (long, *shorts)] == [reference[i] for i in (6, 0, 5)]


def test_prefix_cache_skips_prefill_and_keeps_output(tiny_dir, prompts, reference):
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=128, block_size=8)
    first = llm.generate([prompts[6]], GREEDY)[0]
    second = llm.generate([prompts[6]], GREEDY)[0]
    assert first.metrics["num_cached_tokens"] == 0
    assert second.metrics["num_cached_tokens"] == 56  # (64 - 1) // 8 full blocks of 8
    assert second.token_ids == first.token_ids == reference[6]


def test_yaml_config_drives_the_engine(tiny_dir, tmp_path, prompts, reference):
    from outrider.config import EngineConfig

    cfg = tmp_path / "engine.yaml"
    cfg.write_text(
        f"model: {{model: {tiny_dir[0]}, dtype: float32, device: cpu}}\n"
        "cache: {block_size: 4, num_blocks: 64}\nscheduler: {max_num_seqs: 3}\n"
    )
    config = EngineConfig.from_yaml(cfg)
    assert config.cache.block_size == 4 and config.scheduler.max_num_seqs == 3
    llm = LLM(config=config)
    assert llm.engine.block_manager.num_blocks == 64
    assert [o.token_ids for o in llm.generate(prompts[:3], GREEDY)] == reference[:3]
    cfg.write_text("cache: {blok_size: 4}\n")
    with pytest.raises(ValueError, match="blok_size"):
        EngineConfig.from_yaml(cfg)


def test_request_outgrowing_the_whole_pool_stops_with_length(tiny_dir, prompts):
    # 10 blocks of 8 hold 80 positions, so the context is 80: a 64-token prompt generating to
    # the context's end produces 16 tokens, then stops cleanly instead of preempting itself
    # forever. (Asking for more than 16 is refused up front: tests/unit/test_capacity.py.)
    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=10, block_size=8)
    assert llm.engine.max_model_len == 80
    out = llm.generate(
        [prompts[6]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert llm.engine.block_manager.num_free_blocks == 10


def test_detokenize_false_gives_ids_only(tiny_dir, prompts):  # noqa: F811
    from outrider import LLM, SamplingParams

    llm = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=128)
    with_text = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=12))
    ids_only = llm.generate(
        prompts[:3], SamplingParams(temperature=0, max_tokens=12, detokenize=False)
    )
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in with_text]
    assert all(o.text == "" for o in ids_only) and any(o.text for o in with_text)
    with pytest.raises(ValueError, match="stop strings are matched in the text"):
        SamplingParams(stop=["x"], detokenize=False)
