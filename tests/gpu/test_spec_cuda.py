"""Speculative decoding on CUDA: n-gram greedy output equals plain decoding (fp32), and the
tree-masked verify attention on CUDA equals the CPU reference."""

from __future__ import annotations

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN

pytestmark = pytest.mark.gpu


def test_ngram_greedy_equals_plain_on_cuda():
    convs = [[{"role": "user", "content": p}] for p in GROUNDED[:6] + OPEN[:4]]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.2)
    want = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    spec = LLM(
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.2,
        speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 5},
    )
    outs = spec.chat(convs, params)
    assert [o.token_ids for o in outs] == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_tree_mask_attention_cuda_equals_cpu():
    from outrider.core import ForwardMode
    from outrider.layers.attn_backends.torch_ref import TorchRefBackend
    from outrider.layers.forward_context import AttentionMetadata
    from outrider.speculative.tree import TreeTopology, verify_mask

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 8, 2, 64, 16, 8
    prefix = 37
    topology = TreeTopology.from_parents([-1, -1, 0, 0, 1, 2, 2])
    qlen = 1 + topology.num_nodes
    ctx = prefix + qlen
    block_ids = [5, 1, 7]

    def run(device: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(device)
        v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(device)
        q = torch.randn(qlen, heads, dim, generator=g).to(device)
        k = torch.randn(qlen, kv_heads, dim, generator=g).to(device)
        v = torch.randn(qlen, kv_heads, dim, generator=g).to(device)
        slots = [block_ids[p // bs] * bs + p % bs for p in range(prefix, ctx)]
        meta = AttentionMetadata(
            mode=ForwardMode.VERIFY,
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor([0, qlen], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([ctx], dtype=torch.int32, device=device),
            block_tables=torch.tensor([block_ids], dtype=torch.int32, device=device),
            query_lens_cpu=[qlen],
            seq_lens_cpu=[ctx],
            custom_mask=verify_mask(topology, prefix).to(device),
        )
        cache = {"k": k_cache, "v": v_cache}
        return TorchRefBackend().forward(q, k, v, cache, meta, dim**-0.5).cpu()

    assert torch.allclose(run("cuda"), run("cpu"), atol=1e-4, rtol=1e-4)
