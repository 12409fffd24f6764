"""outrider's Llama family equals HF transformers on the same weights (fp32)."""

import pytest
import torch

from tests.tiny import hf_reference, outrider_model, prefill_batch, run_forward, tiny_hf_config


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]
)
def test_prefill_logits_match_hf(arch):
    hf_cfg = tiny_hf_config(arch)
    ref = hf_reference(hf_cfg)
    model, _ = outrider_model(hf_cfg, ref.state_dict())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33)]
    batch = prefill_batch(prompts)
    hidden = run_forward(model, batch)
    logits = model.compute_logits(hidden)
    start = 0
    for ids in prompts:
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = logits[start : start + len(ids)]
        start += len(ids)
        assert (got - want).abs().max().item() < 1e-4, arch


def _decode_batch(prompts, extra, block_size=16):
    """Sequences that already hold len(p) tokens of KV decode one more token each."""
    from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq

    seqs, nxt = [], 0
    for ids, tok in zip(prompts, extra):
        n = (len(ids) + 1 + block_size - 1) // block_size
        req = Request(prompt_token_ids=list(ids), params=SamplingParams(temperature=0))
        seqs.append(ScheduledSeq(req, [tok], len(ids), list(range(nxt, nxt + n)), sample=True))
        nxt += n
    return ScheduledBatch(ForwardMode.DECODE, seqs)


def test_decode_after_prefill_matches_hf_and_aux_states():
    """Batched decode over paged KV (the one-SDPA-per-layer path) and the aux hidden states
    (residual stream entering layers 2, L//2, L-3 == HF hidden_states[i])."""
    hf_cfg = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=6)
    ref = hf_reference(hf_cfg)
    model, _ = outrider_model(hf_cfg, ref.state_dict())
    g = torch.Generator().manual_seed(2)
    # Blocks are laid out identically by prefill_batch and _decode_batch when each prompt's
    # block count does not change by adding one token (lengths not multiples of 16).
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 20, 40)]
    extra = torch.randint(3, 512, (3,), generator=g).tolist()
    run_forward(model, prefill_batch(prompts))
    aux_layers = model.config.aux_hidden_layers
    hidden, aux = run_forward(model, _decode_batch(prompts, extra), aux_layers=aux_layers)
    logits = model.compute_logits(hidden)
    for i, (ids, tok) in enumerate(zip(prompts, extra)):
        with torch.no_grad():
            out = ref(torch.tensor([ids + [tok]]), output_hidden_states=True)
        assert (logits[i] - out.logits[0, -1]).abs().max().item() < 1e-4
        for a, layer in zip(aux, aux_layers):
            assert (a[i] - out.hidden_states[layer][0, -1]).abs().max().item() < 1e-4
