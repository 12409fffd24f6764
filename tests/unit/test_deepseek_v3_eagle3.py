"""EAGLE-3 on a DeepSeek-V3 target (MLA + routed MoE), fp32 on the CPU: the engine's and the
training capture's aux hidden states equal HF's hidden_states; a drafter trained a few steps
on the tiny model serves speculative greedy output equal to plain (chain and tree), its own
multi-head KV beside the target's latent cache; it saves and loads in SGLang's and vLLM's
layouts, its config naming the target's hidden size and architecture."""

from __future__ import annotations

import json

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq
from outrider.loaders.hf_config import DeepseekV3Config
from outrider.models.eagle3 import Eagle3Config
from outrider.models.eagle3_io import load_drafter, save_drafter
from outrider.train.capture import TargetCapture
from outrider.train.config import TrainConfig
from outrider.train.datagen import generate_dataset
from outrider.train.trainer import train
from tests.unit.test_deepseek_v3 import _hf_config, _hf_model
from tests.unit.test_train_e2e import save_chat_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(checkpoint dir, the transformers model, outrider's LLM over it). Three layers: the
    EAGLE-3 default aux layers (2, L//2, L-3) are (2, 1, 0), all distinct."""
    path = tmp_path_factory.mktemp("tiny-ds3-eagle3")
    ref = _hf_model(_hf_config(q_lora_rank=48, eos_token_id=4))
    with torch.no_grad():
        ref.lm_head.weight.mul_(8.0)  # a peaked target: something a drafter learns in a few steps
    ref.save_pretrained(path, safe_serialization=True)
    save_chat_tokenizer(path)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=256, block_size=16)
    return path, ref, llm


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    _, _, llm = target
    data = tmp_path_factory.mktemp("ds3-data") / "data.jsonl"
    generate_dataset(llm, data, num_samples=16, max_new_tokens=24, batch_size=16)
    config = TrainConfig(
        data=str(data), output_dir=str(tmp_path_factory.mktemp("ds3-drafter")), device="cpu",
        dtype="float32", draft_vocab_size=256, ttt_steps=3, max_len=64, batch_rows=2,
        max_steps=48, lr=3e-3, warmup_ratio=0.1, checkpoint_every=48, log_every=1,
        init_std=0.05, head_from_target=True,
    )  # fmt: skip
    return data, train(config, llm=llm)


def _prompts(data, n=4):
    from outrider.train.dataset import read_samples

    return [s.prompt() for s in read_samples(data)[:n]]


def _spec_llm(path, drafter, **spec):
    spec = {"method": "eagle3", "controller": "fixed", "draft": str(drafter),
            "num_draft_tokens": 3, **spec}  # fmt: skip
    return LLM(str(path), dtype="float32", device="cpu", num_blocks=256, speculative=spec)


def test_the_config_gives_eagle3_layers_and_a_multi_head_draft_layer(target):
    _, _, llm = target
    cfg = llm.engine.runner.model_config
    assert isinstance(cfg, DeepseekV3Config)
    assert cfg.aux_hidden_layers == (2, 1, 0)
    draft = Eagle3Config.for_target(cfg, 256)
    # Llama-style attention over v_head_dim-wide heads, as wide as the target's residual.
    assert (draft.hidden_size, draft.target_hidden_size) == (cfg.hidden_size, cfg.hidden_size)
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (4, 4, 16)
    assert draft.intermediate_size == cfg.intermediate_size and draft.rope_scaling is None


def test_engine_and_training_capture_equal_hf_hidden_states(target):
    _, ref, llm = target
    runner = llm.engine.runner
    ids = torch.randint(5, 512, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
    capture = TargetCapture(llm)
    assert capture.aux_layers == (2, 1, 0)
    feats = capture.features([ids])
    for j, layer in enumerate(capture.aux_layers):
        got = feats.aux[:, j * 64 : (j + 1) * 64]
        assert (got - want[layer][0]).abs().max() < 1e-4, layer
    req = Request(prompt_token_ids=ids, params=SamplingParams(temperature=0))
    batch = ScheduledBatch(ForwardMode.PREFILL, [ScheduledSeq(req, ids, 0, [0, 1], sample=False)])
    _, aux, _ = runner.forward(batch, (1, 2))  # the engine's own pool, as serving runs it
    for layer, got in zip((1, 2), aux, strict=True):
        assert (got - want[layer][0]).abs().max() < 1e-4, layer


def test_a_drafter_trained_on_the_target_serves_losslessly(target, trained):
    path, _, llm = target
    data, result = trained
    first, last = sum(result.losses[:4]) / 4, sum(result.losses[-4:]) / 4
    assert result.step == 48 and last < 0.6 * first, result.losses
    raw = json.loads((result.drafter / "config.json").read_text())
    assert raw["target_hidden_size"] == 64 and raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["outrider"]["target"]["architecture"] == "DeepseekV3ForCausalLM"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, -1]  # SGLang: i - 1
    prompts = _prompts(data)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for spec in ({}, {"topk": 2, "num_steps": 3, "num_draft_tokens": 4}):
        served = _spec_llm(path, result.drafter, **spec)
        proposer = served.engine.speculator.proposer
        # The drafter's pool is its own multi-head layout, beside the target's latent cache.
        assert served.engine.runner.model.kv_layout(torch.float32).is_latent
        assert proposer.kv_pool.layout == proposer.draft.kv_layout(torch.float32)
        assert not proposer.kv_pool.layout.is_latent
        assert [o.token_ids for o in served.generate(prompts, GREEDY)] == plain, spec
        stats = served.engine.speculator.stats
        assert stats.num_verify_steps > 0 and stats.num_accepted_tokens > 0, spec


def test_the_trained_drafter_round_trips_sglang_and_vllm_layouts(target, trained, tmp_path):
    path, _, llm = target
    data, result = trained
    cfg = llm.engine.runner.model_config
    draft = load_drafter(result.drafter, cfg)
    for layout, ids in (("sglang", [1, 0, -1]), ("vllm", [2, 1, 0])):
        out = save_drafter(draft, tmp_path / layout, layout)
        raw = json.loads((out / "config.json").read_text())
        assert raw["target_hidden_size"] == cfg.hidden_size and raw["hidden_size"] == 64
        assert (raw["num_key_value_heads"], raw["head_dim"]) == (4, 16)
        got = (
            raw.get("eagle_aux_hidden_state_layer_ids")
            or raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        )
        assert got == ids, layout
        loaded = load_drafter(out, cfg)
        assert loaded.config == draft.config
        for name, tensor in draft.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (layout, name)
    prompts = _prompts(data)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    served = _spec_llm(path, tmp_path / "sglang")
    assert [o.token_ids for o in served.generate(prompts, GREEDY)] == plain
    assert served.engine.speculator.stats.num_accepted_tokens > 0


def test_the_drafters_pool_shares_the_kv_budget_with_the_targets(target, trained):
    """Pools sized by the byte budget (no num_blocks): the drafter's multi-head pool takes its
    share from the target's latent one, so the two together stay within the budget, both with
    the same block count, and the output is still plain's."""
    path, _, llm = target
    data, result = trained
    budget = 2 << 20
    alone = LLM(str(path), dtype="float32", device="cpu", cpu_kv_bytes=budget)
    spec = {"method": "eagle3", "controller": "fixed", "draft": str(result.drafter),
            "num_draft_tokens": 3}  # fmt: skip
    served = LLM(str(path), dtype="float32", device="cpu", cpu_kv_bytes=budget, speculative=spec)
    runner, proposer = served.engine.runner, served.engine.speculator.proposer
    target_pool, draft_pool = runner.kv_pool.nbytes, proposer.kv_pool.nbytes
    assert alone.engine.runner.kv_pool.nbytes <= budget + target_pool // runner.num_blocks
    # Each pool holds one scratch block past the shared block count.
    block = target_pool // (runner.num_blocks + 1) + draft_pool // (runner.num_blocks + 1)
    assert target_pool + draft_pool <= budget + block
    assert runner.num_blocks < alone.engine.runner.num_blocks
    assert served.engine.block_manager.num_blocks == runner.num_blocks
    prompts = _prompts(data)
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert [o.token_ids for o in served.generate(prompts, GREEDY)] == plain
