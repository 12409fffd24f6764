"""Weight-absorbed MLA (attention in the latent space, kv_b_proj folded into the queries and
outputs) equals the expanded form on random latent caches: a decode batch of different
lengths, chain verify, and tree verify with its mask, within 1e-5 in fp32. Prefill chunks keep
the expanded form."""

import pytest
import torch

from outrider.core import (
    ForwardMode,
    Request,
    SamplingParams,
    ScheduledBatch,
    ScheduledSeq,
    SeqDrafts,
)
from outrider.executor.inputs import build_inputs
from outrider.layers.attn_backends.base import get_backend
from outrider.layers.forward_context import ForwardContext, forward_context
from outrider.layers.rotary import RotaryEmbedding
from outrider.loaders.hf_config import DeepseekV3Config
from outrider.models.deepseek_v3 import DeepseekV3Attention

BLOCK, NUM_BLOCKS, HIDDEN = 16, 24, 64
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
}  # fmt: skip
VARIANTS = {"q_lora": dict(q_lora_rank=48), "q_proj_yarn": dict(rope_scaling=YARN)}


def _config(**over) -> DeepseekV3Config:
    d = dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=HIDDEN,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=256, rope_interleave=True, routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )  # fmt: skip
    d.update(over)
    return DeepseekV3Config.from_hf_dict(d)


@pytest.fixture(params=sorted(VARIANTS))
def layer(request):
    """(config, one MLA layer with random weights over a random latent cache, its rotary)."""
    cfg = _config(**VARIANTS[request.param])
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg).float()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    attn.attn.kv_cache = {"latent": torch.randn(NUM_BLOCKS, BLOCK, width)}
    rotary = RotaryEmbedding(cfg.qk_rope_head_dim, 256, cfg.rope_theta, cfg.rope_scaling)
    return cfg, attn, rotary


def _seq(start, tokens, blocks, drafts=None):
    req = Request(prompt_token_ids=list(range(3, 3 + start + 1)), params=SamplingParams())
    return ScheduledSeq(req, list(tokens), start, blocks, sample=True, drafts=drafts)


def _absorbed_and_expanded(attn, rotary, batch):
    """The layer's output on `batch` absorbed (its mode's default) and forced expanded, and how
    often each form expanded latents into per-head keys and values."""
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(inputs.input_ids.shape[0], HIDDEN, generator=gen)
    rope = rotary.lookup(inputs.positions)
    expand, calls = attn.expand, []
    attn.expand = lambda latent: calls.append(1) or expand(latent)
    outs, expansions = [], []
    try:
        for modes in (attn.attn.absorb_modes, frozenset()):
            attn.attn.absorb_modes = modes
            meta = build_inputs(batch, BLOCK, torch.device("cpu")).attn  # fresh per-step plans
            ctx = ForwardContext(meta, get_backend("torch_ref"))
            with torch.inference_mode(), forward_context(ctx):
                outs.append(attn(rope, hidden))
            expansions.append(len(calls))
            calls.clear()
    finally:
        del attn.expand, attn.attn.absorb_modes
    return outs[0], outs[1], expansions


def _check(attn, rotary, batch):
    absorbed, expanded, (n_absorbed, n_expanded) = _absorbed_and_expanded(attn, rotary, batch)
    assert n_absorbed == 0 and n_expanded > 0  # each form ran as named
    assert expanded.abs().max() > 1e-2  # attention over the random cache is not trivially 0
    assert (absorbed - expanded).abs().max() < 1e-5


def test_decode_batch_of_different_lengths(layer):
    cfg, attn, rotary = layer
    if cfg.rope_scaling:  # YaRN's mscale scales the softmax that both forms share
        assert cfg.softmax_scale != pytest.approx(cfg.qk_head_dim**-0.5)
    batch = ScheduledBatch(
        ForwardMode.DECODE,
        [_seq(0, [7], [0]), _seq(20, [8], [1, 2]), _seq(45, [9], [3, 4, 5]),
         _seq(15, [10], [6])],
    )  # fmt: skip
    _check(attn, rotary, batch)


def test_chain_verify(layer):
    _, attn, rotary = layer
    batch = ScheduledBatch(
        ForwardMode.VERIFY,
        [_seq(30, [5, 11, 12, 13], [0, 1, 2], SeqDrafts.chain([11, 12, 13])),
         _seq(3, [6, 14, 15, 16], [3], SeqDrafts.chain([14, 15, 16]))],
    )  # fmt: skip
    _check(attn, rotary, batch)


def test_tree_verify_honours_the_mask(layer):
    _, attn, rotary = layer
    # root r; n0, n1 children of r; n2 of n0; n3 of n1: each node sees only its ancestors.
    tree = SeqDrafts([21, 22, 23, 24], [-1, -1, 0, 1])
    batch = ScheduledBatch(
        ForwardMode.VERIFY,
        [_seq(40, [6, 21, 22, 23, 24], [0, 1, 2, 3], tree),
         _seq(9, [5, 11, 12], [4], SeqDrafts.chain([11, 12]))],
    )  # fmt: skip
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    assert inputs.attn.tree_mask is not None
    _check(attn, rotary, batch)


def test_prefill_chunks_stay_expanded(layer):
    _, attn, rotary = layer
    batch = ScheduledBatch(
        ForwardMode.PREFILL, [_seq(16, list(range(5, 21)), [0, 1]), _seq(7, [9], [2])]
    )
    absorbed, expanded, (n_default, _) = _absorbed_and_expanded(attn, rotary, batch)
    assert n_default > 0  # PREFILL is not an absorbed mode
    assert torch.equal(absorbed, expanded)
