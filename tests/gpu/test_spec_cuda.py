"""Speculative decoding on CUDA: n-gram greedy output equals plain decoding (fp32), and the
tree-masked verify attention on CUDA (torch_ref and Triton) equals a dense CPU reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN

pytestmark = pytest.mark.gpu


def test_ngram_greedy_equals_plain_on_cuda():
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:6] + OPEN[:4]]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(dtype="float32", device="cuda", num_blocks=1024)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    spec = LLM(
        dtype="float32",
        device="cuda",
        num_blocks=1024,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 5},
    )
    outs = spec.chat(convs, params)
    assert [o.token_ids for o in outs] == want
    assert spec.engine.speculator.stats.num_accepted_tokens > 0


def test_tree_mask_attention_cuda_equals_cpu():
    """The compact tree mask (the ancestor mask over the last 1 + N keys) through torch_ref on
    CUDA and on the CPU and through the Triton kernel equals SDPA under the dense verify_mask."""
    from outrider.core import ForwardMode
    from outrider.layers.attn_backends.torch_ref import TorchRefBackend
    from outrider.layers.attn_backends.triton import TritonBackend
    from outrider.layers.forward_context import AttentionMetadata
    from outrider.speculative.tree import TreeTopology, verify_mask

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 8, 2, 64, 16, 8
    prefix = 37
    topology = TreeTopology.from_parents([-1, -1, 0, 0, 1, 2, 2])
    qlen = 1 + topology.num_nodes
    ctx = prefix + qlen
    block_ids = [5, 1, 7]
    scale = dim**-0.5
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g)
    q = torch.randn(qlen, heads, dim, generator=g)
    k = torch.randn(qlen, kv_heads, dim, generator=g)
    v = torch.randn(qlen, kv_heads, dim, generator=g)
    slots = [block_ids[p // bs] * bs + p % bs for p in range(prefix, ctx)]

    def run(backend, device: str) -> torch.Tensor:
        meta = AttentionMetadata(
            mode=ForwardMode.VERIFY,
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor([0, qlen], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([ctx], dtype=torch.int32, device=device),
            block_tables=torch.tensor([block_ids], dtype=torch.int32, device=device),
            query_lens_cpu=[qlen],
            seq_lens_cpu=[ctx],
            tree_mask=topology.ancestor_mask(device),
        )
        cache = {"k": k_cache.clone().to(device), "v": v_cache.clone().to(device)}
        x = (t.to(device) for t in (q, k, v))
        return backend.forward(*x, cache, meta, scale).cpu()

    # The oracle: this step's k/v written at their slots, then SDPA under the dense mask.
    keys, values = (c.clone().view(-1, kv_heads, dim) for c in (k_cache, v_cache))
    keys[slots], values[slots] = k, v
    order = [b * bs + o for b in block_ids for o in range(bs)][:ctx]
    keys, values = (
        x[order].repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for x in (keys, values)
    )
    mask = verify_mask(topology, prefix)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale
    )
    want = want.transpose(0, 1)
    for backend, device in (
        (TorchRefBackend(), "cpu"),
        (TorchRefBackend(), "cuda"),
        (TritonBackend(), "cuda"),
    ):
        got = run(backend, device)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (type(backend).__name__, device)
