"""Tiny seeded random models shared by the tests: HF transformers builds the reference, outrider
loads the same weights through its own loader path."""

from __future__ import annotations

import torch

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.executor.kv_cache import KVPool
from outrider.loaders.hf_config import TransformerConfig
from outrider.models.registry import model_class
from outrider.models.weights import load_weights

TINY = {
    "LlamaForCausalLM": dict(model_type="llama"),
    "Qwen2ForCausalLM": dict(model_type="qwen2"),
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=32),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=None),
}


def tiny_hf_config(arch: str = "LlamaForCausalLM", **over) -> dict:
    cfg = dict(
        architectures=[arch],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        hidden_act="silu",
    )
    cfg.update(TINY[arch])
    cfg.update(over)
    return cfg


def hf_reference(hf_cfg: dict, seed: int = 0):
    """A transformers model with seeded random weights (scaled so logits are not flat)."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_cfg)
    cls = getattr(transformers, hf_cfg["architectures"][0])
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    return model


def outrider_model(
    hf_cfg: dict, state_dict: dict, num_blocks: int = 64, block_size: int = 16, tp=None
):
    """The outrider model of `hf_cfg` holding `state_dict` (this rank's shard of it under the
    tensor-parallel group `tp`), with a KV pool of this rank's KV heads bound to its layers."""
    cfg = TransformerConfig.from_hf_dict(hf_cfg)
    old = torch.get_default_dtype()
    model = model_class(cfg.architecture)(cfg, tp=tp).float().eval()
    torch.set_default_dtype(old)
    load_weights(model, state_dict.items())
    layers = model.attention_layers()
    layout = model.kv_layout(torch.float32)  # this rank's KV heads
    pool = KVPool(layout, len(layers), num_blocks, block_size, torch.device("cpu"))
    for i, attn in enumerate(layers):
        attn.kv_cache = pool.layer(i)
    return model, pool


def prefill_batch(
    prompts: list[list[int]], block_size: int = 16, first_block: int = 0
) -> ScheduledBatch:
    """A PREFILL batch computing whole prompts, each in its own consecutive blocks."""
    seqs, nxt = [], first_block
    for ids in prompts:
        n = (len(ids) + block_size - 1) // block_size
        req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
        blocks = list(range(nxt, nxt + n))
        nxt += n
        seqs.append(ScheduledSeq(req, list(ids), 0, blocks, sample=True))
    return ScheduledBatch(ForwardMode.PREFILL, seqs)


def run_forward(model, batch: ScheduledBatch, block_size: int = 16, aux_layers=()):
    """One forward of `batch` through `model` with the torch reference backend -> hidden."""
    from outrider.executor.inputs import build_inputs
    from outrider.layers.attn_backends.base import get_backend
    from outrider.layers.forward_context import ForwardContext, forward_context

    inputs = build_inputs(batch, block_size, torch.device("cpu"))
    backend = get_backend("torch_ref")
    with torch.inference_mode(), forward_context(ForwardContext(inputs.attn, backend)):
        hidden, aux = model(inputs.input_ids, inputs.positions, aux_layers)
    return (hidden, aux) if aux_layers else hidden
