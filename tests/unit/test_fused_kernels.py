"""The fused norm / rotary / SiLU kernels (outrider/layers/fused.py) on the CPU under Triton's
interpreter, against the PyTorch path of the same layers: each kernel alone (float32 and
bfloat16, odd widths, strided rows) and a whole tiny Llama forward with the kernels forced on.

float32 results agree to rounding noise. In bfloat16 the interpreter (numpy has no bfloat16)
does not round float32 -> bfloat16 to nearest as the GPU does, so results there may sit one or
two bf16 steps apart; tests/gpu/test_fused_cuda.py asserts the bf16 agreement on real hardware.

As in test_triton_attention.py, TRITON_INTERPRET=1 has to be set before triton is imported, so
the checks run in worker subprocesses that print a JSON line per check (tests/interpreter.py).
"""

from __future__ import annotations

import importlib.util
import itertools
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


def report(name: str, fused_out: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (fused_out.float() - ref.float()).abs().max().item()
    scaled = diff / max(ref.float().abs().max().item(), 1e-30)
    same = (fused_out == ref).float().mean().item()
    emit(name=name, diff=diff, scaled=scaled, same=same)


# moe_gemm's and moe_gemv's INT4 cases, (K, group): K past one K tile and not a multiple of it
# (160), not a multiple of 8 (203), groups that do not divide the K tile (48) or span several
# (256). Every group is a multiple of 8, so moe_gemm runs these few rows as the GEMV.
INT4_CASES = ((160, 32), (203, 32), (192, 48), (512, 256))
MOE_E, MOE_N = 5, 70  # experts, output columns


def crowded_ids() -> torch.Tensor:
    """37 rows crowding two of five experts (three with none, R not a multiple of
    MOE_BLOCK_M, an expert past one block)."""
    return torch.randint(0, 2, (37,), generator=torch.Generator().manual_seed(3))


def int4_case(k_in: int, group: int) -> tuple[torch.Tensor, ...]:
    """-> a [19, K] (two rows each: rows_per_a 2), packed INT4 experts, their scales, and the
    weights they dequantize to (fp32 scales: exactly the kernels' q * scale)."""
    from outrider.loaders.compressed_tensors import dequantize_int4, quantize_int4

    gen = torch.Generator().manual_seed(k_in * 1000 + group)
    w = torch.randn(MOE_E, MOE_N, k_in, generator=gen) / k_in**0.5
    packed, scale = quantize_int4(w, group, torch.float32)
    deq = torch.stack([dequantize_int4(packed[i], scale[i], k_in, group, torch.float32)
                       for i in range(MOE_E)])  # fmt: skip
    return torch.randn(19, k_in, generator=gen), packed, scale, deq


def rowwise(a: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, rpa: int) -> torch.Tensor:
    return torch.stack([a[r // rpa].float() @ w[e].float().T for r, e in enumerate(ids)])


def _worker(part: str) -> None:  # runs in a subprocess, TRITON_INTERPRET=1
    """The INT4 GEMV's own checks ("gemv"), or every other kernel's ("kernels"): two parts of
    about equal length, run side by side where there are two cores."""
    if part == "gemv":
        _gemv()
        return
    from outrider.layers import fused, moe_fused
    from outrider.layers.activation import SiluAndMul
    from outrider.layers.norm import RMSNorm
    from outrider.layers.rotary import Rope, RotaryEmbedding

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        for rows, n in ((3, 128), (5, 100)):
            norm = RMSNorm(n, 1e-5)
            norm.weight.data = (1 + 0.1 * torch.randn(n)).to(dtype)
            wide = torch.randn(rows, n + 7, dtype=dtype)
            x = wide[:, :n]  # strided rows
            res = torch.randn(rows, n, dtype=dtype)
            report(f"norm-{tag}-{n}", fused.rms_norm(x, norm.weight, 1e-5), norm(x))
            out, new_res = fused.rms_norm(x, norm.weight, 1e-5, res)
            ref_out, ref_res = norm(x, res)
            report(f"norm-res-{tag}-{n}", out, ref_out)
            report(f"norm-res-sum-{tag}-{n}", new_res, ref_res)

        heads, kv_heads, dim = 4, 2, 16
        rope_mod = RotaryEmbedding(dim, 64, 10000.0)
        positions = torch.tensor([0, 5, 63, 17, 2])
        qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, dtype=dtype)
        ref = qkv.clone()
        q, k, _ = ref.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        rows = Rope(
            positions, rope_mod.cos[positions][:, None], rope_mod.sin[positions][:, None], False
        )
        rq, rk = RotaryEmbedding.apply(rows, q.view(5, heads, dim), k.view(5, kv_heads, dim))
        table = Rope(positions, rope_mod.cos, rope_mod.sin, True)
        assert RotaryEmbedding.apply_packed_(table, qkv, heads, kv_heads, dim)
        report(f"rotary-q-{tag}", qkv[:, : heads * dim], rq.reshape(5, -1))
        report(f"rotary-k-{tag}", qkv[:, heads * dim : (heads + kv_heads) * dim], rk.reshape(5, -1))
        report(
            f"rotary-v-untouched-{tag}",
            qkv[:, (heads + kv_heads) * dim :],
            ref[:, (heads + kv_heads) * dim :],
        )

        x = torch.randn(4, 2 * 1300, dtype=dtype)  # > one 1024 block, not a power of two
        report(f"silu-{tag}", fused.silu_and_mul(x), SiluAndMul()(x))

    # Top-t log-probabilities: several parts per row (the last one short), one short part, and
    # bfloat16 rows full of ties (their order must be the reference's: lower id first).
    cases = [
        ("f32-3parts", torch.randn(5, 10000), 3),
        ("bf16-ties", torch.randn(4, 9000).to(torch.bfloat16).round(decimals=1), 4),
        ("f32-small", torch.randn(3, 100), 2),
        ("f32-flat", torch.zeros(2, 5000), 3),
        ("f32-strided", torch.randn(3, 6000)[:, :5000], 1),
    ]
    real = fused.use_fused
    fused.use_fused = lambda x: True
    for name, x, t in cases:
        values, ids = fused.top_logprobs(x, t)
        ref_values, ref_ids = fused.top_logprobs_reference(x, t)
        report(f"top-values-{name}", values, ref_values)
        report(f"top-ids-{name}", ids, ref_ids)

    # Slot moves across layers: a destination that is another move's source is read first
    # (slot 5 -> 2 while 2 -> 1), a move onto itself, widths past one column chunk.
    for width, moves in ((12, ([5, 2, 7, 9], [2, 1, 7, 3])), (300, ([4, 6], [6, 0]))):
        pool = torch.randn(3, 10, width)
        src, dst = (torch.tensor(m) for m in moves)
        ref = pool.clone()
        ref.index_copy_(1, dst, ref.index_select(1, src))
        assert fused.move_slots_(pool, src, dst)
        report(f"move-slots-{width}", pool, ref)

    # Tree acceptance in one launch against tree_batch's ops: random trees (siblings carry
    # distinct tokens), padding nodes, argmax over a small vocabulary so that paths run deep.
    from outrider.executor.inputs import table_slots_no_sync
    from outrider.speculative.tree_batch import (
        accept_tree_greedy_no_sync,
        ancestors_np,
        tree_kv_moves_no_sync,
    )

    gen = torch.Generator().manual_seed(3)
    for b, n, steps in ((5, 6, 3), (4, 16, 5), (12, 1, 1)):
        parents = torch.full((b, n), -1, dtype=torch.int64)
        drafts = torch.zeros(b, n, dtype=torch.int64)
        for row in range(b):
            depth = [0] * n
            kids: dict[int, int] = {}
            for i in range(n):
                options = [-1] + [j for j in range(i) if depth[j] < steps]
                p = options[int(torch.randint(len(options), (1,), generator=gen))]
                parents[row, i] = p
                depth[i] = 1 if p < 0 else depth[p] + 1
                drafts[row, i] = kids.get(p, 0)  # distinct among siblings
                kids[p] = kids.get(p, 0) + 1
        anc_np, depth_np = ancestors_np(parents.numpy())
        anc, depth = torch.from_numpy(anc_np), torch.from_numpy(depth_np)
        argmax = torch.randint(0, 3, (b, 1 + n), generator=gen)
        num_nodes = torch.randint(0, n + 1, (b,), generator=gen)
        starts = torch.randint(0, 40, (b,), generator=gen)
        tables = torch.randint(0, 50, (b, 9), generator=gen, dtype=torch.int32)
        tree = (argmax, drafts, parents, anc, depth, num_nodes)
        got = fused.accept_tree(*tree, starts, tables, 4, steps)
        path, acc = accept_tree_greedy_no_sync(*tree, steps)
        src, dst = tree_kv_moves_no_sync(path, acc, starts)
        want = (
            path, acc, argmax.gather(1, path),
            table_slots_no_sync(tables, src, 4), table_slots_no_sync(tables, dst, 4),
        )  # fmt: skip
        for part, g, w in zip(("path", "accepted", "tokens", "src", "dst"), got, want):
            report(f"tree-{part}-{n}", g, w)
        report(f"tree-deep-{n}", acc.max().clamp(max=1).float(), torch.tensor(1.0))

    # One step of growing trees in one launch against the torch ops it replaces (distinct
    # random scores: no ties), t = 3 (padded to 4) and 4, a hidden row past one block.
    for b, t, m, h in ((3, 3, 6, 40), (2, 4, 12, 1100)):
        scores = torch.randn(b, t)
        child_logp = -torch.rand(b * t, t)
        child = torch.randint(0, 50, (b * t, t), generator=gen)
        d2t = torch.randint(0, 9, (50,), generator=gen)
        summed = torch.randn(b * t, h)
        anc = torch.rand(b, t, m, generator=gen) < 0.5
        got = fused.grow_select(scores, child_logp, child, d2t, summed, anc)
        cum = (scores[:, :, None] + child_logp.view(b, t, t)).view(b, t * t)
        want_scores, pick = cum.topk(t, dim=-1)
        parent = pick // t
        tok = child.view(b, t * t).gather(1, pick)
        want_hidden = summed.view(b, t, h).gather(1, parent[..., None].expand(-1, -1, h))
        want_anc = anc.gather(1, parent[..., None].expand(-1, -1, m))
        own = torch.eye(t, dtype=torch.bool)[None].expand(b, -1, -1)
        want = (want_scores, parent, tok + d2t[tok], want_hidden, torch.cat([want_anc, own], -1))
        for part, g, w in zip(("scores", "parent", "tokens", "hidden", "anc"), got, want):
            report(f"grow-{part}-{t}", g, w)
    fused.use_fused = real

    # The MoE forward in two moe_gemm launches against the reference loop over experts: T 3,
    # top_k 2, E 5; bf16-shaped experts with odd widths (K not a multiple of the tile's block_k), INT4
    # ones with K a multiple of 8 and of the group (as Kimi's), past one K tile. fp32 scales:
    # the reference's dequantized fp32 weight is then exactly the kernel's q * scale.
    from outrider.layers.moe import FusedExperts, Int4FusedExperts
    from outrider.loaders.compressed_tensors import quantize_int4

    def moe_inputs(hidden: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(3, hidden)
        ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(3)])
        weights = torch.rand(3, 2, generator=gen) + 0.5
        return x, weights, ids

    hidden, inter = 203, 45
    plain = FusedExperts(5, hidden, inter)
    plain.gate_up_proj.data = torch.randn(5, 2 * inter, hidden) / hidden**0.5
    plain.down_proj.data = torch.randn(5, hidden, inter) / inter**0.5
    moe_cases = [("bf16-layout-f32", plain, moe_inputs(hidden))]
    hidden, inter, group = 160, 96, 32
    int4 = Int4FusedExperts(5, hidden, inter, group)
    for name, shape in (
        ("gate_up_proj", (5, 2 * inter, hidden)),
        ("down_proj", (5, hidden, inter)),
    ):
        w = torch.randn(shape) / shape[-1] ** 0.5
        packed, scale = quantize_int4(w, group, torch.float32)
        getattr(int4, f"{name}_packed").data = packed
        getattr(int4, f"{name}_scale").data = scale
    moe_cases.append(("int4-f32", int4, moe_inputs(hidden)))
    for name, experts, (x, weights, ids) in moe_cases:
        ref = experts.forward_reference(x, weights, ids)
        fused.use_fused = lambda x: True
        report(f"moe-{name}", experts(x, weights, ids), ref)
        fused.use_fused = real
        report(f"moe-{name}-nonzero", ref.abs().max().clamp(max=1), torch.tensor(1.0))

    # moe_gemm alone against a row-by-row product: crowded rows, rows sharing activation rows
    # (rows_per_a 2), one row; INT4_CASES; unquantized fp32, bf16 (interpreter: within bf16
    # steps) and odd K.
    fused.use_fused = lambda x: True
    e, n = MOE_E, MOE_N
    crowded = crowded_ids()
    routings = {"crowded": crowded, "one": torch.tensor([3]), "spread": torch.arange(10) % 5}
    for (route, ids), rpa in itertools.product(routings.items(), (1, 2)):
        a = torch.randn(-(-ids.numel() // rpa), 203)
        w = torch.randn(e, n, 203) / 203**0.5
        report(
            f"moe-gemm-f32-{route}-{rpa}",
            moe_fused.moe_gemm(a, ids, w, rpa),
            rowwise(a, ids, w, rpa),
        )
    for k_in, group in INT4_CASES:
        a, packed, scale, deq = int4_case(k_in, group)
        got = moe_fused.moe_gemm(a, crowded, packed, 2, scale, group)  # GEMV where it serves
        report(f"moe-gemm-int4-{k_in}-{group}", got, rowwise(a, crowded, deq, 2))
        tiles = moe_fused.moe_gemm(a, crowded, packed, 2, scale, group, tile=moe_fused.MoeTile())
        report(f"moe-gemm-int4-{k_in}-{group}-tiles", tiles, rowwise(a, crowded, deq, 2))
    a, w = torch.randn(37, 100, dtype=torch.bfloat16), torch.randn(e, n, 100, dtype=torch.bfloat16)
    report("moe-gemm-bf16", moe_fused.moe_gemm(a, crowded, w), rowwise(a, crowded, w, 1))
    layout = moe_fused.moe_layout_no_sync(crowded, e)
    report("moe-gemm-layout-reused", moe_fused.moe_gemm(a, crowded, w, layout=layout),
           moe_fused.moe_gemm(a, crowded, w))  # fmt: skip
    fused.use_fused = real

    # A whole tiny Llama forward (prefill of two prompts), kernels forced on vs off.
    sys.path.insert(0, str(ROOT))
    from tests.tiny import hf_reference, outrider_model, prefill_batch, run_forward, tiny_hf_config

    cfg = tiny_hf_config()
    state = hf_reference(cfg).state_dict()
    prompts = [[5, 9, 33, 100, 7], list(range(40, 71))]
    model, _ = outrider_model(cfg, state)
    plain = run_forward(model, prefill_batch(prompts))
    fused.use_fused = lambda x: True
    model, _ = outrider_model(cfg, state)
    report("llama-forward-f32", run_forward(model, prefill_batch(prompts)), plain)

    # Structured outputs' token bitmask in one launch against the torch ops (use_fused is
    # forced on from here).
    from outrider.executor import sampler

    gen = torch.Generator().manual_seed(3)
    for vocab, words in ((100, 4), (1000, 30)):  # 1000 > 30 * 32: the last tokens refused
        logits = torch.randn(6, vocab, generator=gen)
        bits = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=gen).to(torch.int32)
        bits[0] = -1  # a row that allows every token its words cover
        got = sampler.apply_token_bitmask_(logits.clone(), bits)
        want = logits.clone()
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(6, -1).bool()
        allowed = torch.cat([allowed, allowed.new_zeros(6, max(0, vocab - 32 * words))], 1)
        want.masked_fill_(~allowed[:, :vocab], float("-inf"))
        emit(
            name=f"bitmask-{vocab}",
            same=bool(torch.equal(got, want)),
            refused=int(torch.isinf(want).sum()),
            tail_refused=bool(torch.isinf(got[:, 32 * words :]).all()),
        )

        # The greedy token among what the mask allows, rows picked by index, in one launch.
        logits[2, [7, 60]] = 50.0  # a tie among allowed tokens: the lower one
        bits[2, 0] |= 1 << 7
        bits[2, 1] |= 1 << (60 - 32)
        bits[4] = 0  # a row that allows nothing
        rows = torch.tensor([4, 2, 0, 2])
        got = fused.masked_argmax(logits, rows, bits[rows].contiguous())
        want = sampler.apply_token_bitmask_(logits[rows].clone(), bits[rows]).argmax(dim=-1)
        emit(name=f"masked-argmax-{vocab}", same=bool(torch.equal(got, want)),
             tie=int(got[1]), nothing=int(got[0]))  # fmt: skip

    # Each row's 16 best tokens (ties to the lowest) in two launches, over vocabularies of one
    # chunk, of several with a short last one, and of fewer tokens than 16.
    for vocab, dtype in ((1000, torch.float32), (5000, torch.float32), (5000, torch.bfloat16),
                         (10, torch.float32)):  # fmt: skip
        logits = torch.randn(4, vocab, generator=gen).to(dtype)
        tied = [t for t in (4999, 2100, 10, 7) if t < vocab]
        logits[1, tied] = 50.0  # a tie across chunks: lowest token first
        logits[2] = 1.0  # a row tied everywhere
        logits[3, : vocab // 2] = float("-inf")  # half refused, as a masked row is
        k = min(sampler.GRAMMAR_TOPK, vocab)
        got = fused.top_candidates(logits, k)
        same = got is not None and got.dtype == torch.float64
        for r in range(4):
            row = logits[r].float().tolist()
            order = sorted(range(vocab), key=lambda t: (-row[t], t))[:k]
            same = same and got[r, :k].tolist() == order
            same = same and got[r, k:].tolist() == [row[t] for t in order]
        emit(name=f"top-candidates-{vocab}-{str(dtype)[6:]}", same=bool(same),
             tied=[int(t) for t in got[1, : len(tied)].tolist()])  # fmt: skip


def _gemv() -> None:
    """moe_gemv itself at INT4_CASES, gated too against the tensor-core path's gated GEMM."""
    from outrider.layers import fused, moe_fused

    fused.use_fused = lambda x: True
    crowded = crowded_ids()
    for k_in, group in INT4_CASES:
        a, packed, scale, deq = int4_case(k_in, group)
        gemv = moe_fused.moe_gemv(a, crowded, packed, 2, scale, group)
        report(f"moe-gemv-int4-{k_in}-{group}", gemv, rowwise(a, crowded, deq, 2))
        gated = moe_fused.moe_gemv(a, crowded, packed, 2, scale, group, gated=True)
        want = moe_fused.moe_gemm(
            a, crowded, packed, 2, scale, group, gated=True, tile=moe_fused.MoeTile()
        )
        report(f"moe-gemv-gated-int4-{k_in}-{group}", gated, want)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    parts = ["kernels", "gemv"]
    return {r["name"]: r for r in run_worker("tests.unit.test_fused_kernels", parts=parts)}


BF16_STEPS = 2**-6  # two bfloat16 rounding steps, relative to the largest value


def _close(r: dict, dtype: str) -> bool:
    return r["diff"] <= 1e-5 if dtype == "float32" else r["scaled"] <= BF16_STEPS


@pytest.mark.parametrize("vocab", [100, 1000])
def test_token_bitmask_in_one_launch_matches_the_torch_ops(results, vocab):
    r = results[f"bitmask-{vocab}"]
    assert r["same"] and r["refused"] > 0 and r["tail_refused"], r


@pytest.mark.parametrize("vocab", [100, 1000])
def test_masked_argmax_in_one_launch_matches_the_torch_ops(results, vocab):
    r = results[f"masked-argmax-{vocab}"]
    assert r["same"] and r["tie"] == 7 and r["nothing"] == 0, r


@pytest.mark.parametrize("case", ["1000-float32", "5000-float32", "5000-bfloat16", "10-float32"])
def test_top_candidates_in_two_launches_rank_as_a_sort_by_logit_then_token(results, case):
    """fused.top_candidates: each row's best tokens, best first and ties to the lowest token,
    their logits as float32 holds them, exactly as a sort by (-logit, token) gives them."""
    r = results[f"top-candidates-{case}"]
    vocab = int(case.split("-")[0])
    assert r["same"], r
    assert r["tied"] == sorted(t for t in (4999, 2100, 10, 7) if t < vocab), r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("width", [128, 100])
def test_rms_norm_matches_torch(results, dtype, width):
    for name in (
        f"norm-{dtype}-{width}",
        f"norm-res-{dtype}-{width}",
        f"norm-res-sum-{dtype}-{width}",
    ):
        assert _close(results[name], dtype), results[name]
    if dtype == "float32":  # the residual sum is one rounded add on both paths
        assert results[f"norm-res-sum-{dtype}-{width}"]["same"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_in_place_matches_torch(results, dtype):
    assert _close(results[f"rotary-q-{dtype}"], dtype), results[f"rotary-q-{dtype}"]
    assert _close(results[f"rotary-k-{dtype}"], dtype), results[f"rotary-k-{dtype}"]
    assert results[f"rotary-v-untouched-{dtype}"]["same"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_silu_and_mul_matches_torch(results, dtype):
    assert _close(results[f"silu-{dtype}"], dtype), results[f"silu-{dtype}"]


def test_llama_forward_with_fused_kernels_matches_plain(results):
    assert results["llama-forward-f32"]["diff"] <= 1e-4


@pytest.mark.parametrize(
    "case", ["f32-3parts", "bf16-ties", "f32-small", "f32-flat", "f32-strided"]
)
def test_top_logprobs_kernel_matches_reference(results, case):
    assert results[f"top-ids-{case}"]["same"] == 1.0, results[f"top-ids-{case}"]
    assert results[f"top-values-{case}"]["diff"] <= 1e-5, results[f"top-values-{case}"]


@pytest.mark.parametrize("width", [12, 300])
def test_move_slots_reads_every_source_before_writing(results, width):
    assert results[f"move-slots-{width}"]["same"] == 1.0, results[f"move-slots-{width}"]


@pytest.mark.parametrize("n", [6, 16, 1])
def test_tree_acceptance_in_one_launch_matches_the_torch_ops(results, n):
    for part in ("path", "accepted", "tokens", "src", "dst"):
        assert results[f"tree-{part}-{n}"]["same"] == 1.0, (part, results[f"tree-{part}-{n}"])
    assert results[f"tree-deep-{n}"]["same"] == 1.0  # some row accepted a draft


@pytest.mark.parametrize("t", [3, 4])
def test_tree_growth_step_in_one_launch_matches_the_torch_ops(results, t):
    for part in ("scores", "parent", "tokens", "hidden", "anc"):
        assert results[f"grow-{part}-{t}"]["same"] == 1.0, (part, results[f"grow-{part}-{t}"])


@pytest.mark.parametrize("case", ["bf16-layout-f32", "int4-f32"])
def test_fused_moe_forward_matches_the_reference_loop(results, case):
    # fp32 throughout: only the order of the sums differs (the kernel's K tiles, the top_k
    # outputs summed once rather than added to the output one expert at a time).
    assert results[f"moe-{case}"]["scaled"] <= 1e-5, results[f"moe-{case}"]
    assert results[f"moe-{case}-nonzero"]["same"] == 1.0  # the reference output is not ~0


@pytest.mark.parametrize("route", ["crowded", "one", "spread"])
@pytest.mark.parametrize("rows_per_a", [1, 2])
def test_moe_gemm_matches_the_row_by_row_product(results, route, rows_per_a):
    r = results[f"moe-gemm-f32-{route}-{rows_per_a}"]
    assert r["scaled"] <= 1e-5, r


@pytest.mark.parametrize("path", ["", "-tiles"])
@pytest.mark.parametrize("case", ["160-32", "203-32", "192-48", "512-256"])
def test_moe_gemm_int4_matches_the_dequantized_product(results, case, path):
    # "": moe_gemm's own choice (the GEMV for these few rows where the group allows it);
    # "-tiles": a tile given, the tensor-core grouped GEMM.
    r = results[f"moe-gemm-int4-{case}{path}"]
    assert r["scaled"] <= 1e-5, r


@pytest.mark.parametrize("case", ["160-32", "203-32", "192-48", "512-256"])
def test_int4_gemv_matches_the_dequantized_product_and_the_gated_grouped_gemm(results, case):
    r = results[f"moe-gemv-int4-{case}"]
    assert r["scaled"] <= 1e-5, r
    # silu(gate) * up from one launch, as the tensor-core path computes it (sums reordered).
    r = results[f"moe-gemv-gated-int4-{case}"]
    assert r["scaled"] <= 1e-5, r


def test_int4_gemv_refuses_groups_that_split_a_word():
    from outrider.layers import moe_fused

    ids = torch.tensor([0])
    packed = torch.zeros(1, 4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="group_size=12"):
        moe_fused.moe_gemv(torch.randn(1, 24), ids, packed, 1, torch.ones(1, 4, 2), 12)


def test_moe_gemm_bf16_and_a_shared_layout(results):
    assert results["moe-gemm-bf16"]["scaled"] <= BF16_STEPS, results["moe-gemm-bf16"]
    assert results["moe-gemm-layout-reused"]["same"] == 1.0


def test_moe_layout_groups_rows_by_expert_in_padded_blocks():
    from outrider.layers.moe_fused import MOE_BLOCK_M, moe_layout_no_sync, moe_layout_slots

    # The docstring's example at the real block size: expert 0's rows, expert 1 has none,
    # expert 2's rows, then a padding block (the bound for 6 rows over 3 experts is 3 blocks).
    layout = moe_layout_no_sync(torch.tensor([2, 0, 2, 2, 2, 0]), 3).view(-1, MOE_BLOCK_M)
    assert layout.shape == (3, MOE_BLOCK_M) and layout.dtype == torch.int32
    pad = [-1] * MOE_BLOCK_M
    assert layout.tolist() == [[1, 5, *pad[2:]], [0, 2, 3, 4, *pad[4:]], pad]
    # Any routing fits the static bound, every row appears once, blocks hold one expert.
    gen = torch.Generator().manual_seed(0)
    for rows, experts in ((8, 384), (40, 3), (100, 7), (1, 1)):
        ids = torch.randint(0, experts, (rows,), generator=gen)
        ids[: rows // 2] = 0  # one crowded expert
        layout = moe_layout_no_sync(ids, experts)
        assert layout.numel() == moe_layout_slots(rows, experts)
        real = layout[layout >= 0].long()
        assert sorted(real.tolist()) == list(range(rows))
        for block in layout.view(-1, MOE_BLOCK_M):
            if block[0] >= 0:
                assert ids[block[block >= 0].long()].unique().numel() == 1
    assert moe_layout_slots(8, 384) == 8 * MOE_BLOCK_M  # one token: its 8 rows' blocks only


def test_moe_gemm_refuses_a_layout_built_for_other_shapes(monkeypatch):
    from outrider.layers import fused, moe_fused

    monkeypatch.setattr(fused, "use_fused", lambda x: True)
    ids = torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match="moe_layout_no_sync"):
        moe_fused.moe_gemm(torch.randn(3, 8), ids, torch.randn(2, 4, 8), layout=torch.zeros(16))


def test_top_logprobs_reference_is_log_softmax_topk_with_ties_to_the_lower_id():
    from outrider.layers.fused import top_logprobs_reference

    x = torch.randn(6, 300)
    values, ids = top_logprobs_reference(x, 4)
    want_values, want_ids = torch.log_softmax(x, dim=-1).topk(4, dim=-1)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(values, want_values, atol=1e-6)
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    assert top_logprobs_reference(tied, 4)[1].tolist() == [[1, 3, 4, 2]]
    with pytest.raises(ValueError, match="t=0"):
        from outrider.layers.fused import top_logprobs

        top_logprobs(x, 0)
