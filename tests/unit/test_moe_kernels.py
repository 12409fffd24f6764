"""The MoE routing kernels (outrider/layers/moe_fused.py) on the CPU under Triton's interpreter,
against their torch references: the router's choice (DeepSeek-V3's grouped sigmoid top-k, with
and without group pruning and renormalisation), the expert layout, the weighted sum of each
token's expert rows, and a tiny DeepSeek-V3 forward with them and the MLA glue kernel on. The
checks run in one interpreter subprocess (tests/interpreter.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests.interpreter import ROOT, emit, run_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
]

# (name, experts, top_k, n_group, topk_group, norm_topk_prob, scaling, always, hidden)
ROUTERS = [
    ("deepseek-v3", 256, 8, 8, 4, True, 2.5, 1, 48),
    ("kimi", 384, 8, 1, 1, True, 2.827, 0, 48),
    ("moonlight", 64, 6, 1, 1, True, 2.446, 2, 48),
    ("odd-unnormed", 24, 3, 3, 2, False, 1.0, 0, 48),
    ("wide-hidden", 64, 6, 2, 1, True, 2.0, 1, 1000),
]
# (name, rows, experts): one token, a chunk and a half, many slots past one fill, one expert.
LAYOUTS = [("one", 8, 384), ("chunks", 100, 7), ("wide", 600, 384), ("single", 40, 1)]


def _worker(part: str) -> None:  # runs in a subprocess, TRITON_INTERPRET=1
    """The kernels one by one ("kernels"), the gate kernel for one router ("gate-<name>"), or
    whole tiny DeepSeek-V3 forwards ("forward"): parts run side by side, as the cores allow."""
    if part == "forward":
        _forward()
        return
    if part.startswith("gate-"):
        _gate(next(row for row in ROUTERS if row[0] == part.removeprefix("gate-")))
        return
    from outrider.layers import fused, moe_fused
    from outrider.layers.moe import GroupedTopkRouter

    real = fused.use_fused

    gen = torch.Generator().manual_seed(0)
    for name, experts, top_k, groups, keep, norm, scaling, always, hidden in ROUTERS:
        tokens = 5
        router = GroupedTopkRouter(hidden, experts, top_k, groups, keep, norm, scaling, always)
        router.weight.data = torch.randn(experts, hidden, generator=gen)
        router.e_score_correction_bias.data = torch.randn(experts, generator=gen) * 0.5
        x = torch.randn(tokens, hidden, generator=gen)
        want_w, want_ids = router(x)  # CPU: the torch path
        logits = torch.nn.functional.linear(x, router.weight)
        got_w, got_ids = moe_fused.moe_route_no_sync(
            x, router.weight, router.e_score_correction_bias, top_k, groups, keep, norm,
            scaling, always,
        )  # fmt: skip
        # Order within a token is unspecified on the torch side: compare by expert.
        order_g, order_w = got_ids.argsort(1), want_ids.argsort(1)
        ids_g, ids_w = got_ids.gather(1, order_g), want_ids.gather(1, order_w)
        w_g, w_w = got_w.gather(1, order_g), want_w.gather(1, order_w)
        biased = logits.sigmoid() + router.e_score_correction_bias
        routed = got_ids[:, :top_k]
        descending = bool((biased.gather(1, routed).diff(dim=1) <= 0).all())
        shared = list(range(experts, experts + always))
        always_last = got_ids[:, top_k:].tolist() == [shared] * tokens and bool(
            (got_w[:, top_k:] == 1).all()
        )
        emit(
            name=f"route-{name}",
            same_ids=torch.equal(ids_g, ids_w),
            weight_diff=(w_g - w_w).abs().max().item(),
            descending=descending,
            always_last=always_last,
            width=got_ids.shape[1],
            dtypes=[str(got_w.dtype), str(got_ids.dtype)],
        )

    for name, rows, experts in LAYOUTS:
        ids = torch.randint(0, experts, (rows,), generator=gen)
        ids[: rows // 3] = experts - 1  # one crowded expert, the last
        fused.use_fused = lambda x: True
        got = moe_fused.moe_layout_no_sync(ids, experts)
        fused.use_fused = lambda x: False
        want = moe_fused.moe_layout_no_sync(ids, experts)  # the torch reference
        emit(name=f"layout-{name}", same=torch.equal(got, want), dtype=str(got.dtype))

    for dtype in (torch.float32, torch.bfloat16):
        tokens, top_k, n = 6, 3, 200
        rows = torch.randn(tokens * top_k, n, generator=gen).to(dtype)
        weights = torch.rand(tokens, top_k, generator=gen)
        add = torch.randn(tokens, n, generator=gen).to(dtype)
        summed = (rows.view(tokens, top_k, n).float() * weights[..., None]).sum(1).to(dtype)
        for with_add in (False, True):
            got = moe_fused.moe_combine(rows, weights, add if with_add else None)
            want = summed + add if with_add else summed
            diff = (got.float() - want.float()).abs().max().item()
            emit(
                name=f"combine-{str(dtype).removeprefix('torch.')}-{with_add}",
                scaled=diff / want.float().abs().max().item(),
                same=torch.equal(got, want),
            )

    # The gated grouped GEMM against the plain one followed by torch's silu(gate) * up.
    from outrider.loaders.compressed_tensors import quantize_int4

    fused.use_fused = lambda x: True
    ids = torch.randint(0, 5, (21,), generator=gen)
    a = torch.randn(7, 160, generator=gen)
    w = torch.randn(5, 2 * 40, 160, generator=gen) / 160**0.5
    packed, scale = quantize_int4(w, 32, torch.float32)
    for name, args in (("values", (w,)), ("int4", (packed, 3, scale, 32))):
        weight, rest = args[0], args[1:]
        rows_per_a = 3
        if name == "values":
            two = moe_fused.moe_gemm(a, ids, weight, rows_per_a)
            got = moe_fused.moe_gemm(a, ids, weight, rows_per_a, gated=True)
        else:
            two = moe_fused.moe_gemm(a, ids, weight, *rest)
            got = moe_fused.moe_gemm(a, ids, weight, *rest, gated=True)
        gate, up = two.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        diff = (got - want).abs().max().item()
        emit(name=f"gated-{name}", scaled=diff / want.abs().max().item(), shape=list(got.shape))
    fused.use_fused = real

    # mla_prep_ storing each token's latent into the paged cache at its slot (negative: none)
    # in the same launch, against its latent scattered by write_latent_cache.
    from outrider.layers.attn_backends.triton_mla import write_latent_cache

    tokens, heads, rank, half = 5, 3, 32, 4
    q0 = torch.randn(tokens, heads, 16 + 2 * half, generator=gen)
    kv = torch.randn(tokens, rank + 2 * half, generator=gen)
    norm_w = torch.rand(rank, generator=gen) + 0.5
    positions = torch.tensor([0, 3, 9, 2, 7])
    angles = torch.rand(16, half, generator=gen) * 6
    slots = torch.tensor([3, 7, -1, 12, 0])
    want_cache = torch.full((4, 4, rank + 2 * half), 7.0)
    q_want, q_got, got_cache = q0.clone(), q0.clone(), want_cache.clone()
    prep = (norm_w, 1e-6, positions, angles.cos(), angles.sin(), True)
    latent = fused.mla_prep_(q_want, kv, *prep)
    write_latent_cache(latent, want_cache, slots)
    got = fused.mla_prep_(q_got, kv, *prep, sink=(got_cache, slots))
    emit(
        name="mla-prep-sink",
        same_latent=bool(torch.equal(got, latent)),
        same_q=bool(torch.equal(q_got, q_want)),
        same_cache=bool(torch.equal(got_cache, want_cache)),
        untouched=int((got_cache == 7.0).all(-1).sum()),
    )


def _gate(row: tuple) -> None:
    """The router's logits, choice and layout in one launch, at one token, a few and the most.
    A part of its own for each router: the interpreter's time goes on these launches (a
    program per slice of the experts, each looping over the tokens)."""
    from outrider.layers import fused, moe_fused
    from outrider.layers.moe import GroupedTopkRouter

    real = fused.use_fused
    gen = torch.Generator().manual_seed(0)
    name, experts, top_k, groups, keep, norm, scaling, always, hidden = row
    router = GroupedTopkRouter(hidden, experts, top_k, groups, keep, norm, scaling, always)
    router.weight.data = torch.randn(experts, hidden, generator=gen)
    router.e_score_correction_bias.data = torch.randn(experts, generator=gen) * 0.5
    for tokens in (1, 5, moe_fused.GATE_MAX_TOKENS):
        x = torch.randn(tokens, hidden, generator=gen)
        want_w, want_ids = router(x)  # CPU: the torch path
        got_w, got_ids, layout = moe_fused.moe_gate_no_sync(
            x, router.weight, router.e_score_correction_bias, top_k, groups, keep, norm,
            scaling, always,
        )  # fmt: skip
        order_g, order_w = got_ids.argsort(1), want_ids.argsort(1)
        bare = None  # layout=False: at one token (see the test)
        if tokens == 1:
            bare_w, bare_ids, none = moe_fused.moe_gate_no_sync(
                x, router.weight, router.e_score_correction_bias, top_k, groups, keep, norm,
                scaling, always, layout=False,
            )  # fmt: skip
            bare = none is None and torch.equal(bare_ids, got_ids) and torch.equal(bare_w, got_w)
        fused.use_fused = lambda x: False
        want_layout = moe_fused.moe_layout_no_sync(got_ids, experts + always)
        fused.use_fused = real
        emit(
            name=f"gate-{name}-{tokens}",
            same_ids=torch.equal(got_ids.gather(1, order_g), want_ids.gather(1, order_w)),
            weight_diff=(got_w.gather(1, order_g) - want_w.gather(1, order_w)).abs().max().item(),
            same_layout=torch.equal(layout, want_layout),
            count=int(moe_fused._gate_count(x.device).item()),
            width=got_ids.shape[1],
            bare=bare,
        )


def _forward() -> None:
    from outrider.layers import fused, moe_fused

    real = fused.use_fused
    # A whole tiny DeepSeek-V3 prefill (MoE layers routed, laid out, combined; every MLA
    # layer's norm and rotaries in mla_prep_), kernels forced on against off, interleaved
    # rotary pairs and not.
    sys.path.insert(0, str(ROOT))
    from outrider.loaders.hf_config import config_from_hf
    from outrider.models.registry import model_class
    from tests.tiny import prefill_batch, run_forward

    def tiny_deepseek(interleave: bool, int4: bool = False):
        hf = {**TINY_DEEPSEEK, "rope_interleave": interleave}
        if int4:  # routed experts INT4 as Kimi ships them (compressed-tensors, group 32)
            hf["quantization_config"] = TINY_INT4
        cfg = config_from_hf(hf)
        model = model_class(cfg.architecture)(cfg).float().eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dtype == torch.int32:  # packed nibbles: every value in use
                    p.copy_(torch.randint(-(2**31), 2**31 - 1, p.shape, generator=g))
                    continue
                noise = torch.randn(p.shape, generator=g)
                if name.endswith("_scale"):  # INT4 scales: positive, W ~ 0.05
                    p.copy_(0.01 * noise.abs())
                else:
                    p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        layers = model.attention_layers()
        pool = KVPool(model.kv_layout(torch.float32), len(layers), 16, 16, torch.device("cpu"))
        for i, attn in enumerate(layers):
            attn.kv_cache = pool.layer(i)
        return model

    from outrider.executor.kv_cache import KVPool

    # 36 tokens: routed by cuBLAS's logits and one program per token; 7: by moe_gate_kernel.
    for short in (False, True):
        prompts = (
            [[5, 9, 33], [7, 8, 100, 2]] if short else [[5, 9, 33, 100, 7], list(range(40, 71))]
        )
        for interleave in (True, False):
            fused.use_fused = real
            plain = run_forward(tiny_deepseek(interleave), prefill_batch(prompts))
            fused.use_fused = lambda x: True
            got = run_forward(tiny_deepseek(interleave), prefill_batch(prompts))
            fused.use_fused = real
            diff = (got - plain).abs().max().item()
            emit(
                name=f"deepseek-forward-{interleave}{'-short' if short else ''}",
                scaled=diff / plain.abs().max().item(),
            )
        # INT4 experts: their GEMV reads no layout, and neither the router nor the experts
        # make one (counted: every layout the forward builds goes through moe_layout_no_sync).
        plain = run_forward(tiny_deepseek(False, int4=True), prefill_batch(prompts))
        fused.use_fused = lambda x: True
        layouts, real_layout = [], moe_fused.moe_layout_no_sync

        def counted(*a, layouts=layouts, real_layout=real_layout, **k):
            layouts.append(1)
            return real_layout(*a, **k)

        moe_fused.moe_layout_no_sync = counted
        got = run_forward(tiny_deepseek(False, int4=True), prefill_batch(prompts))
        moe_fused.moe_layout_no_sync = real_layout
        fused.use_fused = real
        emit(
            name=f"deepseek-forward-int4{'-short' if short else ''}",
            scaled=(got - plain).abs().max().item() / plain.abs().max().item(),
            layouts=len(layouts),
        )


TINY_INT4 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "actorder": None},
    }},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
    "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    # The longer first: Kimi's 384 experts and DeepSeek-V3's 256 take the gate kernel longest,
    # then the forwards; on two cores the parts end within seconds of each other.
    gates = [f"gate-{row[0]}" for row in sorted(ROUTERS, key=lambda row: -row[1])]
    parts = [*gates[:2], "forward", *gates[2:], "kernels"]
    return {r["name"]: r for r in run_worker("tests.unit.test_moe_kernels", parts=parts)}


@pytest.mark.parametrize("name", [r[0] for r in ROUTERS])
def test_route_chooses_the_references_experts_with_its_weights(results, name):
    r = results[f"route-{name}"]
    assert r["same_ids"], r
    assert r["weight_diff"] <= 1e-6, r
    assert r["descending"], r  # choices in descending biased score
    always = next(row[7] for row in ROUTERS if row[0] == name)
    top_k = next(row[2] for row in ROUTERS if row[0] == name)
    assert r["always_last"] and r["width"] == top_k + always, r  # the shared experts last
    assert r["dtypes"] == ["torch.float32", "torch.int64"]


@pytest.mark.parametrize("name", [r[0] for r in ROUTERS])
def test_gate_kernel_routes_and_lays_out_as_the_router_and_layout(results, name):
    """moe_gate_no_sync (logits, choice and layout in one launch; its last program routes)
    against the torch router and the layout reference, at 1, 5 and GATE_MAX_TOKENS tokens."""
    for tokens in (1, 5, 16):
        r = results[f"gate-{name}-{tokens}"]
        assert r["same_ids"] and r["same_layout"], r
        assert r["weight_diff"] <= 1e-6, r
        assert r["count"] == 0, r  # the arrival count is back to zero for the next launch
        # Asked for no layout (INT4 experts read none): none, the rest the same. At one token
        # only: the flag skips the layout's writes whatever the tokens, and each launch of
        # Kimi's 384 experts takes the interpreter seconds.
        assert r["bare"] is (True if tokens == 1 else None), r


@pytest.mark.parametrize("name", [r[0] for r in LAYOUTS])
def test_layout_kernel_equals_the_torch_reference(results, name):
    r = results[f"layout-{name}"]
    assert r["same"] and r["dtype"] == "torch.int32", r


def test_combine_sums_in_fp32_then_adds_as_torch_rounds(results):
    for with_add in (False, True):
        assert results[f"combine-float32-{with_add}"]["scaled"] <= 1e-6
    # The interpreter truncates fp32 -> bf16 (numpy has no bf16): within one bf16 step, twice.
    for with_add in (False, True):
        assert results[f"combine-bfloat16-{with_add}"]["scaled"] <= 2**-6


@pytest.mark.parametrize("weights", ["values", "int4"])
def test_gated_grouped_gemm_equals_the_gemm_then_silu_and_mul(results, weights):
    r = results[f"gated-{weights}"]
    assert r["scaled"] <= 1e-6 and r["shape"] == [21, 40], r


@pytest.mark.parametrize("short", ["", "-short"])
@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_forward_with_the_kernels_equals_the_torch_ops(results, interleave, short):
    # fp32: only sums' order differs (the norm, the top_k sum, the GEMMs' K tiles, the router).
    r = results[f"deepseek-forward-{interleave}{short}"]
    assert r["scaled"] <= 1e-5, r


@pytest.mark.parametrize("short", ["", "-short"])
def test_deepseek_forward_with_int4_experts_and_the_kernels_equals_the_torch_ops(results, short):
    # 7 tokens routed by moe_gate_kernel with no layout (the GEMV reads none), 36 by the route
    # kernel: both into the INT4 GEMV, and no layout is built for it (the experts built one
    # when the router had not: a kernel a layer for nothing).
    r = results[f"deepseek-forward-int4{short}"]
    assert r["scaled"] <= 1e-5 and r["layouts"] == 0, r


def test_mla_prep_stores_the_latents_where_write_latent_cache_would(results):
    r = results["mla-prep-sink"]
    assert r["same_latent"] and r["same_q"] and r["same_cache"], r
    assert r["untouched"] == 4 * 4 - 4, r  # four slots written, slot -1 none


def test_route_refuses_groups_that_do_not_divide_the_experts():
    from outrider.layers.moe_fused import moe_route_no_sync

    x, router, bias = torch.zeros(2, 8), torch.zeros(64, 8), torch.zeros(64)
    with pytest.raises(ValueError, match="n_group=5"):
        moe_route_no_sync(x, router, bias, 6, 5, 2, True, 1.0)
    with pytest.raises(ValueError, match="topk_group=3"):
        moe_route_no_sync(x, router, bias, 6, 2, 3, True, 1.0)
