"""DeepSeek-V3 split over ranks on the CPU (gloo over loopback): MLA's query heads and every
MLP's and expert's intermediate width split, the latent and the router whole on every rank.
Greedy output at TP 2 equals TP 1 through `LLM`, plain and with n-gram drafts, unquantized
and with INT4 experts, and a forward pays two all-reduces per layer (one for the whole MoE
block, shared experts included)."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.distributed import TPGroup
from outrider.layers.moe import Int4FusedExperts
from outrider.loaders.checkpoint import open_checkpoint
from outrider.loaders.hf_config import check_tp_size
from outrider.models.deepseek_v3 import DeepseekV3ForCausalLM
from outrider.models.weights import load_weights
from tests.unit.test_deepseek_v3 import VOCAB, _hf_config, _outrider, tiny_ds  # noqa: F401
from tests.unit.test_deepseek_v3_int4 import GROUP, int4_checkpoint, int4_ds  # noqa: F401
from tests.unit.test_tp_engine import NGRAM, TIGHT, _per_forward

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def int4_tp_ds(tmp_path_factory):
    """An INT4-expert checkpoint whose expert width (64) splits over 2 ranks in whole groups
    of 32 (test_deepseek_v3_int4's 40 splits over none)."""
    return int4_checkpoint(tmp_path_factory, _hf_config(q_lora_rank=48, moe_intermediate_size=64))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    return prompts + [prompts[1] * 3]  # a repeat gives n-gram lookup something to draft


def _tp2_equals_tp1(path) -> None:
    """TP 2 with n-gram drafts, then plainly, under TIGHT's chunked prefill: the greedy tokens
    of TP 1, and 2 x layers + 1 (the embedding's) all-reduces and one all-gather (the LM
    head's) per decode or verify forward."""
    prompts = _prompts() * 2
    want = [o.token_ids for o in LLM(str(path), **TIGHT).generate(prompts, GREEDY)]
    with LLM(str(path), tensor_parallel_size=2, **TIGHT, speculative=NGRAM) as llm:
        engine = llm.engine
        cfg = engine.checkpoint.config
        layers = cfg.num_hidden_layers
        attn = engine.runner.model.attention_layers()[0]
        assert attn.num_heads == cfg.num_attention_heads // 2
        # The latent is whole on every rank: kv_lora_rank + qk_rope_head_dim per token.
        assert engine.runner.kv_pool.tensors["latent"].shape[-1] == 32 + 8

        def run(name: str) -> dict:
            engine.runner.reset_collective_counts()
            outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            assert outs == want, f"{name}: TP=2 differs from TP=1"
            return engine.runner.collective_counts()

        counts = run("ngram")
        assert engine.speculator.stats.num_verify_steps > 0
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)
        engine.speculator.use_proposer(None)
        counts = run("plain")
        assert _per_forward(counts, "decode") == (2 * layers + 1, 1)
        prefill = counts["prefill"]
        assert prefill["all_reduce"]["calls"] == (2 * layers + 1) * prefill["forward"]["calls"]
    codes = [p.exitcode for p in engine._ranks.procs]
    assert codes == [0] * len(codes), codes  # STOP ended the rank cleanly


@pytest.mark.slow
def test_tp2_equals_tp1_plain_and_ngram(tiny_ds):  # noqa: F811
    """q through q_a/q_b (q_lora) and straight through q_proj with YaRN (q_proj_yarn)."""
    _tp2_equals_tp1(tiny_ds[0])


@pytest.mark.slow
def test_tp2_with_int4_experts_equals_tp1(int4_tp_ds):
    _tp2_equals_tp1(int4_tp_ds[0])


def _shards(path, size: int = 2) -> list[DeepseekV3ForCausalLM]:
    """Each rank's model of the checkpoint at `path`, without processes (nothing reduces)."""
    ckpt = open_checkpoint(path)
    models = []
    for rank in range(size):
        model = DeepseekV3ForCausalLM(ckpt.config, tp=TPGroup(rank, size, group=object()))
        load_weights(model.float(), ckpt.iter_tensors())
        models.append(model)
    return models


def test_shards_hold_their_heads_and_expert_slices(tiny_ds, int4_tp_ds):  # noqa: F811
    """Rank r holds heads [2r, 2r + 2) of q and kv_b (rows) and o_proj (columns), the whole
    latent projections and router, and rows / columns [r I/2, (r + 1) I/2) of every expert,
    of the shared experts and of the dense MLP; INT4 experts hold the packed words and scale
    groups of those columns, and dequantize to the slice of the whole expert."""
    for path in (tiny_ds[0], int4_tp_ds[0]):
        whole, _ = _outrider(path)
        for rank, shard in enumerate(_shards(path)):
            w, s = whole.model.layers[1], shard.model.layers[1]
            q = "q_b_proj" if hasattr(w.self_attn, "q_b_proj") else "q_proj"
            for name, per_head in ((q, 24), ("kv_b_proj", 32)):
                rows = getattr(w.self_attn, name).weight.view(4, per_head, -1)[2 * rank :][:2]
                assert torch.equal(getattr(s.self_attn, name).weight, rows.flatten(0, 1)), name
            o = w.self_attn.o_proj.weight[:, 32 * rank :][:, :32]
            assert torch.equal(s.self_attn.o_proj.weight, o)
            for name in ("kv_a_proj_with_mqa", "kv_a_layernorm"):
                assert torch.equal(
                    getattr(s.self_attn, name).weight, getattr(w.self_attn, name).weight
                )
            assert torch.equal(s.mlp.gate.weight, w.mlp.gate.weight)
            mlps = [(whole.model.layers[0].mlp, shard.model.layers[0].mlp)]
            folded = range(8, 8 + s.mlp.experts.num_shared)  # unquantized: after the routed
            if s.mlp.shared_experts is not None:  # INT4 experts: a separate bf16 MLP
                # Its down projection leaves its reduction to the MoE block.
                assert not s.mlp.shared_experts.down_proj.reduce
                mlps.append((w.mlp.shared_experts, s.mlp.shared_experts))
            else:
                assert len(folded) == 1
            i = whole.model.layers[1].mlp.experts.intermediate // 2
            for e in (0, 5, *folded):
                got = s.mlp.experts.expert_weights(e, torch.float32)
                gate_up, down = w.mlp.experts.expert_weights(e, torch.float32)
                gate, up = gate_up.view(2, -1, gate_up.shape[-1])[:, rank * i :][:, :i]
                assert torch.equal(got[0], torch.cat([gate, up]))
                assert torch.equal(got[1], down[:, rank * i :][:, :i])
            for wm, sm in mlps:
                assert torch.equal(sm.down_proj.weight, wm.down_proj.weight.chunk(2, 1)[rank])
    experts = _shards(int4_tp_ds[0])[1].model.layers[1].mlp.experts
    # 32 inputs a rank: 4 words and one scale group of each expert's down rows.
    assert experts.down_proj_packed.shape == (8, 64, 4)
    assert experts.down_proj_scale.shape == (8, 64, 1)


def test_sizes_that_cannot_split_fail_at_start_naming_the_fix(tiny_ds, int4_ds):  # noqa: F811
    with pytest.raises(
        ValueError, match=r"4 attention heads.*use tensor_parallel_size in \[1, 2, 4\]"
    ):
        LLM(str(tiny_ds[0]), tensor_parallel_size=3, dtype="float32", device="cpu")
    cfg = open_checkpoint(tiny_ds[0]).config
    with pytest.raises(ValueError, match=r"4 attention heads.*\[1, 2, 4\]"):
        DeepseekV3ForCausalLM(cfg, tp=TPGroup(0, 3, group=object()))
    # INT4 experts of width 40 over 2 ranks: 20 inputs a rank, not whole groups of 32.
    with pytest.raises(ValueError, match=r"INT4 expert width 40 into multiples of 32.*in \[1\]"):
        LLM(str(int4_ds[0]), tensor_parallel_size=2, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"moe_intermediate_size 64 .* leaves 16 .* in \[1, 2\]"):
        Int4FusedExperts(8, 64, 64, GROUP, tp=TPGroup(0, 4, group=object()))
    check_tp_size(cfg, 4)
