"""The fused norm / rotary / SiLU kernels on CUDA against the PyTorch path, in bfloat16 where
rounding matters: they must round where torch rounds (the CPU suite checks their logic under
the interpreter, which cannot round bf16 as the GPU does)."""

from __future__ import annotations

import pytest
import torch

from outrider.layers import fused, moe_fused
from outrider.layers.activation import SiluAndMul
from outrider.layers.norm import RMSNorm
from outrider.layers.rotary import Rope, RotaryEmbedding

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_grad():
    """The fused kernels serve forwards without autograd (serving runs in inference mode)."""
    with torch.no_grad():
        yield


def test_fused_kernels_step_aside_under_autograd():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    with torch.enable_grad():
        assert not fused.use_fused(x)  # no backward: training must run the PyTorch ops


def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [576, 4096, 5120])
def test_rms_norm_rounds_like_torch(dtype, width, monkeypatch):
    torch.manual_seed(0)
    norm = RMSNorm(width, 1e-5).cuda().to(dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(33, width, device="cuda", dtype=dtype)
    res = torch.randn(33, width, device="cuda", dtype=dtype)
    assert fused.use_fused(x)
    out, new_res = norm(x, res)
    plain = norm(x)
    monkeypatch.setenv("OUTRIDER_FUSED_KERNELS", "0")
    assert not fused.use_fused(x)
    ref_out, ref_res = norm(x, res)
    assert torch.equal(new_res, ref_res)  # one rounded add on both paths
    if dtype != torch.float32:  # low precision: only the fp32 sum order differs, rarely seen
        assert _same(out, ref_out) >= 0.99
        assert _same(plain, norm(x)) >= 0.99
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64)])
def test_rotary_in_place_rounds_like_torch(dtype, heads, kv_heads, dim):
    rope = RotaryEmbedding(dim, 8192, 500000.0).cuda()
    positions = torch.randint(0, 8192, (19,), device="cuda")
    qkv = torch.randn(19, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    ref = qkv.clone()
    q, k, v = ref.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    rows = Rope(positions, rope.cos[positions][:, None], rope.sin[positions][:, None], False)
    rq, rk = RotaryEmbedding.apply(rows, q.reshape(19, heads, dim), k.reshape(19, kv_heads, dim))
    assert RotaryEmbedding.apply_packed_(rope.lookup(positions), qkv, heads, kv_heads, dim)
    out_q, out_k, out_v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    if dtype != torch.float32:
        assert _same(out_q, rq.reshape(19, -1)) >= 0.99
        assert _same(out_k, rk.reshape(19, -1)) >= 0.99
    assert torch.equal(out_v, v)
    torch.testing.assert_close(out_q, rq.reshape(19, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_rounds_like_torch(dtype, monkeypatch):
    x = 3 * torch.randn(7, 2 * 14336, device="cuda", dtype=dtype)
    out = SiluAndMul()(x)
    monkeypatch.setenv("OUTRIDER_FUSED_KERNELS", "0")
    ref = SiluAndMul()(x)
    if dtype != torch.float32:
        assert _same(out, ref) >= 0.99
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows,vocab,t", [(1, 32000, 3), (48, 32000, 3), (7, 128256, 8), (3, 50, 1)]
)
def test_top_logprobs_matches_reference(dtype, rows, vocab, t):
    """The draft trees' candidates: ids exactly the reference's (ties to the lower id: bf16
    logits tie often), log-probabilities to fp32 rounding."""
    torch.manual_seed(0)
    x = (3 * torch.randn(rows, vocab, device="cuda")).to(dtype)
    values, ids = fused.top_logprobs(x, t)
    ref_values, ref_ids = fused.top_logprobs_reference(x, t)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layers,slots,width", [(30, 4096, 192), (2, (1 << 20) + 5, 1024)])
def test_move_slots_matches_index_copy(layers, slots, width):
    """One launch equals index_select + index_copy_, also over a pool past 2^31 values (the
    second case: 64-bit offsets), with chained moves (a destination that is another source)."""
    torch.manual_seed(0)
    pool = torch.randn(layers, slots, width, device="cuda", dtype=torch.bfloat16)
    src = torch.tensor([slots - 1, 7, 9, 3, 100, 5], device="cuda")
    dst = torch.tensor([7, 6, 9, slots - 2, 3, 1], device="cuda")
    others = torch.tensor([0, 2, 4, 8, slots - 1], device="cuda")  # no move writes these
    moved = pool.index_select(1, src)  # what each destination must hold after
    kept = pool.index_select(1, others)
    assert fused.move_slots_(pool, src, dst)
    assert torch.equal(pool.index_select(1, dst), moved)
    assert torch.equal(pool.index_select(1, others), kept)


@pytest.mark.parametrize("t,h", [(4, 576), (8, 4096)])
def test_grow_select_matches_the_torch_ops(t, h):
    """A tree growth step in one launch equals the ops it replaces (distinct scores: no ties)."""
    torch.manual_seed(1)
    b, m = 16, 3 * t
    dev = "cuda"
    scores = torch.randn(b, t, device=dev)
    child_logp = -torch.rand(b * t, t, device=dev)
    child = torch.randint(0, 1000, (b * t, t), device=dev)
    d2t = torch.randint(0, 50, (1000,), device=dev)
    summed = torch.randn(b * t, h, device=dev, dtype=torch.bfloat16)
    anc = torch.rand(b, t, m, device=dev) < 0.5
    got = fused.grow_select(scores, child_logp, child, d2t, summed, anc)
    assert got is not None
    want_scores, pick = (scores[:, :, None] + child_logp.view(b, t, t)).view(b, -1).topk(t)
    parent = pick // t
    tok = child.view(b, t * t).gather(1, pick)
    want_hidden = summed.view(b, t, h).gather(1, parent[..., None].expand(-1, -1, h))
    want_anc = torch.cat(
        [
            anc.gather(1, parent[..., None].expand(-1, -1, m)),
            torch.eye(t, device=dev, dtype=torch.bool)[None].expand(b, -1, -1),
        ],
        -1,
    )
    for g, w in zip(got, (want_scores, parent, tok + d2t[tok], want_hidden, want_anc)):
        assert torch.equal(g, w)


def test_accept_tree_matches_the_torch_ops():
    """Tree acceptance in one launch equals tree_batch's ops on random trees (distinct
    sibling tokens, padding nodes, a small vocabulary so paths run deep)."""
    from outrider.executor.inputs import table_slots_no_sync
    from outrider.speculative.tree_batch import (
        accept_tree_greedy_no_sync,
        ancestors_no_sync,
        tree_kv_moves_no_sync,
    )

    g = torch.Generator().manual_seed(5)
    b, n, steps = 32, 16, 5
    parents = torch.full((b, n), -1, dtype=torch.int64)
    drafts = torch.zeros(b, n, dtype=torch.int64)
    for row in range(b):
        depth, kids = [0] * n, {}
        for i in range(n):
            options = [-1] + [j for j in range(i) if depth[j] < steps]
            p = options[int(torch.randint(len(options), (1,), generator=g))]
            parents[row, i], depth[i] = p, 1 if p < 0 else depth[p] + 1
            drafts[row, i] = kids.get(p, 0)
            kids[p] = kids.get(p, 0) + 1
    parents, drafts = parents.cuda(), drafts.cuda()
    anc, depth = ancestors_no_sync(parents, steps)
    argmax = torch.randint(0, 3, (b, 1 + n), generator=g).cuda()
    num_nodes = torch.randint(0, n + 1, (b,), generator=g).cuda()
    starts = torch.randint(0, 400, (b,), generator=g).cuda()
    tables = torch.randint(0, 5000, (b, 40), generator=g, dtype=torch.int32).cuda()
    tree = (argmax, drafts, parents, anc, depth, num_nodes)
    got = fused.accept_tree(*tree, starts, tables, 16, steps)
    path, acc = accept_tree_greedy_no_sync(*tree, steps)
    src, dst = tree_kv_moves_no_sync(path, acc, starts)
    want = (
        path, acc, argmax.gather(1, path),
        table_slots_no_sync(tables, src, 16), table_slots_no_sync(tables, dst, 16),
    )  # fmt: skip
    assert acc.max() >= 2  # paths ran deep enough to test the walk
    for got_part, want_part in zip(got, want):
        assert torch.equal(got_part, want_part)


def _kimi_like_experts(int4: bool, hidden: int = 1024, inter: int = 256, num: int = 16):
    """Random experts at Kimi-K2's ratios shrunk (H 7168 -> 1024, I 2048 -> 256, 384 -> 16
    experts), bf16, INT4 packed with group 32 as Kimi ships them (or plain bf16)."""
    from outrider.layers.moe import FusedExperts, Int4FusedExperts
    from outrider.loaders.compressed_tensors import quantize_int4

    torch.manual_seed(0)
    shapes = {"gate_up_proj": (num, 2 * inter, hidden), "down_proj": (num, hidden, inter)}
    if not int4:
        experts = FusedExperts(num, hidden, inter)
        for name, shape in shapes.items():
            getattr(experts, name).data = torch.randn(shape) / shape[-1] ** 0.5
        return experts.cuda().to(torch.bfloat16)
    experts = Int4FusedExperts(num, hidden, inter, 32)
    for name, shape in shapes.items():
        packed, scale = quantize_int4(torch.randn(shape) / shape[-1] ** 0.5, 32, torch.bfloat16)
        getattr(experts, f"{name}_packed").data = packed
        getattr(experts, f"{name}_scale").data = scale
    return experts.cuda()


def _routing(tokens: int, num: int = 16, top_k: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, num, device="cuda").topk(top_k, dim=-1).indices  # distinct
    weights = torch.rand(tokens, top_k, device="cuda") / top_k * 2.5
    return weights, ids


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_w4a16_moe_forward_matches_dequantize_then_bf16(tokens):
    """The fused W4A16 forward against the reference loop (dequantize each expert to bf16, bf16
    GEMMs, outputs added in bf16 one expert at a time), both measured against the fp32 truth
    (the same packed weights dequantized to fp32, fp32 activations). The fused path rounds the
    dequantized weights to bf16 as the reference does and keeps the top_k sum in fp32, so it
    should be about as far from the truth as the bf16 reference (both round the weights,
    gate_up, silu * up and down to bf16); three times the
    reference's largest error (or 2^-7 of the output's scale, for an unluckily small reference
    error) leaves room for which of those roundings land where: under the CPU interpreter,
    whose bf16 casts truncate, the ratio was 2.2 at T=1 and 1.6 at T=8. A wrong nibble, scale
    group, expert or row is an error of the output's own size (~1 here, against ~0.01)."""
    experts = _kimi_like_experts(int4=True)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(tokens)
    assert fused.use_fused(x)
    out = experts(x, weights, ids)
    ref = experts.forward_reference(x, weights, ids)
    truth = experts.forward_reference(x.float(), weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    err = (out.float() - truth).abs().max().item()
    ref_err = (ref.float() - truth).abs().max().item()
    assert err <= max(3 * ref_err, 2**-7 * truth.abs().max().item()), (err, ref_err)
    assert truth.abs().max() > 0.1  # the outputs are not vanishingly small


@pytest.mark.parametrize("int4", [True, False])
def test_fused_moe_forward_replays_in_a_cuda_graph(int4):
    """The fused forward reads nothing on the host, so it captures in a CUDA graph (a host read
    raises during capture), and a replay on new routing equals the eager forward."""
    experts = _kimi_like_experts(int4=int4)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    weights, ids = _routing(16)
    experts(x, weights, ids)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, weights, ids)
    new_x = torch.randn_like(x)
    new_weights, new_ids = _routing(16)
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert torch.equal(out, experts(new_x, new_weights, new_ids))


@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048)])  # gate_up, down
def test_w4a16_moe_gemm_at_kimi_dims_matches_dequantize_then_bf16(n, k):
    """One moe_gemm at Kimi-K2.5's real sizes (384 experts, top 8 of them for 16 tokens, INT4
    group 32; gate_up's 7168 -> 4096 with a token's 8 rows sharing its activation row, down's
    2048 -> 7168) against each row through F.linear on the expert dequantized to bf16, both
    measured against fp32 products of the same bf16 weights. Random packed words (every nibble
    in use) made on the device: 5.6 GB for gate_up, none of it through host memory."""
    from outrider.loaders.compressed_tensors import dequantize_int4

    torch.manual_seed(0)
    experts, tokens, top_k, group = 384, 16, 8, 32
    words = torch.randint(-(2**31), 2**31, (experts, n, k // 8), dtype=torch.int32, device="cuda")
    scale = torch.rand(experts, n, k // group, device="cuda") + 0.5
    scale = (scale / (21 * k) ** 0.5).to(torch.bfloat16)  # outputs of about unit size
    rows_per_a = top_k if k == 7168 else 1
    _, ids = _routing(tokens, num=experts, top_k=top_k)
    rows = ids.reshape(-1)
    a = torch.randn(rows.numel() // rows_per_a, k, device="cuda", dtype=torch.bfloat16)
    out = moe_fused.moe_gemm(a, rows, words, rows_per_a, scale, group)
    ref = torch.empty_like(out)
    truth = torch.empty(out.shape, device="cuda")
    for e in rows.unique().tolist():  # CPU-GPU sync point: the test's reference only
        w = dequantize_int4(words[e], scale[e], k, group, torch.bfloat16)  # [n, k]
        hit = (rows == e).nonzero().squeeze(1)
        x = a[hit // rows_per_a]
        ref[hit] = torch.nn.functional.linear(x, w)
        truth[hit] = x.float() @ w.float().T
    assert out.shape == (rows.numel(), n) and out.dtype == torch.bfloat16
    err = (out.float() - truth).abs().max().item()
    ref_err = (ref.float() - truth).abs().max().item()
    assert err <= max(2 * ref_err, 2**-7 * truth.abs().max().item()), (err, ref_err)
    assert truth.abs().max() > 0.5


@pytest.mark.parametrize("gated, tokens", [(True, 1), (True, 16), (False, 4), (False, 64)])
def test_int4_dequant_pairs_equal_the_per_element_path(gated, tokens, monkeypatch):
    """The PTX path that dequantizes two INT4 words a call (moe_kernels._DEQUANT_PAIRS) makes
    the same bf16 weights as the one-element-at-a-time path, so moe_gemm's outputs are equal
    bit for bit, gate_up (gated, rows sharing a token's activation) and down alike; every
    nibble value occurs (random words) and the scales differ per group and column."""
    torch.manual_seed(0)
    experts, top_k, group, n, k = 64, 8, 32, 512, 1024
    words = torch.randint(-(2**31), 2**31, (experts, n, k // 8), dtype=torch.int32, device="cuda")
    scale = ((torch.rand(experts, n, k // group, device="cuda") + 0.5) / k**0.5).bfloat16()
    rows_per_a = top_k if gated else 1
    _, ids = _routing(tokens, num=experts, top_k=top_k)
    rows = ids.reshape(-1)
    a = torch.randn(rows.numel() // rows_per_a, k, device="cuda", dtype=torch.bfloat16)

    def run(pairs: bool) -> torch.Tensor:
        monkeypatch.setattr(moe_fused, "INT4_DEQUANT_PAIRS", pairs)
        assert moe_fused._dequant(a, group) == (2 if pairs else 1)
        return moe_fused.moe_gemm(a, rows, words, rows_per_a, scale, group, gated=gated)

    out, per_element = run(True), run(False)
    assert out.abs().max() > 0.1
    assert torch.equal(out, per_element)


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_candidates_rank_as_torch_topk_with_ties_to_the_lowest_token(rows, dtype):
    """fused.top_candidates at the default model's vocabulary: the same values as torch.topk,
    and the ids a sort by (-logit, token) gives (bf16 logits tie often)."""
    torch.manual_seed(0)
    logits = torch.randn(rows, 49152, device="cuda").to(dtype)
    logits[0, [40000, 3, 2049]] = 30.0
    got = fused.top_candidates(logits, 16)
    values, _ = logits.float().topk(16, dim=-1)
    assert torch.equal(got[:, 16:], values.double())
    order = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :16]  # ties: lowest
    assert torch.equal(got[:, :16].long(), order)
    assert got[0, :3].long().tolist() == [3, 2049, 40000]


@pytest.mark.parametrize("rows", [1, 64])
def test_ngram_drafts_match_the_torch_ops(rows, monkeypatch):
    """The n-gram lookup in one launch at the step's real window (2,049 tokens a row)."""
    from outrider.speculative.ngram import DEVICE_WINDOW
    from outrider.speculative.ngram_device import ngram_drafts_no_sync

    gen = torch.Generator(device="cuda").manual_seed(0)
    window = torch.randint(0, 40, (rows, DEVICE_WINDOW + 1), device="cuda", generator=gen)
    valid = torch.ones_like(window, dtype=torch.bool)
    valid[rows // 2, :1000] = False
    with torch.inference_mode():
        got = fused.ngram_drafts(window, valid, 1, 4, 4)
        monkeypatch.setattr(fused, "use_fused", lambda x: False)
        want = ngram_drafts_no_sync(window, valid, 1, 4, 4)
    assert got is not None and torch.equal(got, want)
