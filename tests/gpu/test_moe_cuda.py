"""The MoE routing kernels at the real models' sizes on CUDA, against their torch references,
and the kernels one DeepSeek-V3 MoE layer costs in a captured decode graph."""

from __future__ import annotations

import pytest
import torch

from outrider.layers import moe_fused
from outrider.layers.moe import GroupedTopkRouter
from tests.benchmarks import load_benchmark

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "experts, top_k, groups, keep, scaling, always",
    [(256, 8, 8, 4, 2.5, 1), (384, 8, 1, 1, 2.827, 0), (64, 6, 1, 1, 2.446, 2)],  # V3, Kimi, ML
)
@pytest.mark.parametrize("tokens", [1, 64, 1024])
@pytest.mark.parametrize("bf16_weight", [False, True])
def test_route_kernel_chooses_as_the_torch_router(
    experts, top_k, groups, keep, scaling, always, tokens, bf16_weight
):
    """bf16_weight: a router stored in bf16 (as checkpoints ship it) takes the one-GEMM
    logits (bf16 in, fp32 out), which must choose and weigh as the fp32 GEMV."""
    torch.manual_seed(0)
    # fp32: the models' own widths (the gate kernel's tiles as they serve). bf16: a width whose
    # sums in the GEMM's order and the fp32 GEMV's stay within 1e-6 (at 7168 they part by 3e-6).
    hidden = 1024 if bf16_weight else (2048 if experts == 64 else 7168)
    router = GroupedTopkRouter(hidden, experts, top_k, groups, keep, True, scaling, always)
    router = router.cuda()
    router.weight.data.normal_(0, 0.02)
    if bf16_weight:
        router.weight.data = router.weight.data.bfloat16().float()
    router.e_score_correction_bias.data.normal_(0, 0.05)
    router.after_load()
    assert (router.weight_bf16 is not None) == bf16_weight
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got_w, got_ids = router(x)  # the fused path
        logits = torch.nn.functional.linear(x.float(), router.weight)
        with torch.inference_mode(False), torch.enable_grad():  # use_fused: off with autograd
            want_w, want_ids = router(x)
    og, ow = got_ids.argsort(1), want_ids.argsort(1)
    same = (got_ids.gather(1, og) == want_ids.gather(1, ow)).all(1)
    # Exact ties between two biased fp32 scores may pick either; none in random data.
    assert same.float().mean().item() == 1.0
    torch.testing.assert_close(got_w.gather(1, og), want_w.gather(1, ow), rtol=1e-6, atol=1e-7)
    assert logits.shape == (tokens, experts)


@pytest.mark.parametrize("rows, experts", [(8, 384), (6 * 64, 64), (8 * 1024, 384), (3, 1)])
def test_layout_kernel_equals_the_reference(rows, experts):
    ids = torch.randint(0, experts, (rows,), device="cuda")
    ids[: rows // 4] = 0
    got = moe_fused.moe_layout_no_sync(ids, experts)
    want = moe_fused.moe_layout_reference(ids, experts)
    assert torch.equal(got, want)


def test_kernels_per_moe_layer_in_the_captured_decode_graph():
    """The Moonlight shape cut to 2 and 3 layers (1 dense, then MoE): the difference of kernels
    per replayed decode step is one MoE layer's (attention and MoE block)."""
    bench = load_benchmark("moe_gpu.py")
    counts = {}
    for layers in (2, 3):
        hf = {**bench.MOONLIGHT, "num_hidden_layers": layers}
        counts[layers] = bench.kernels_per_decode_step(hf, concurrency=1)
    per_layer = counts[3] - counts[2]
    # 15: norm, the q and kv_a projections' one GEMM, the MLA glue (latents stored in the
    # cache too), two absorbed products, attention and its split merge, o_proj, norm, the
    # router's GEMM (bf16 in, fp32 out) and choice, layout, two grouped GEMMs, combine.
    assert 0 < per_layer <= 15, counts
