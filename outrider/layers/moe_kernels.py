"""The Triton kernels behind outrider/layers/moe_fused.py (imported only when one is first used):
a MoE layer's routing, its expert layout, its grouped GEMMs and the weighted sum of each
token's expert outputs, one launch each."""

from __future__ import annotations

import triton
import triton.language as tl

from outrider.layers.fused_kernels import next_pow2  # noqa: F401 (moe_fused sizes tiles with it)


@triton.jit
def moe_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scale,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, KEEP_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, ALWAYS: tl.constexpr, NORM: tl.constexpr, G_PAD: tl.constexpr,
    S_PAD: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    # One program per token.
    t = tl.program_id(0).to(tl.int64)
    width = TOP_K + ALWAYS
    _route_token(
        logits_ptr + t * stride_l, bias_ptr, weights_ptr + t * width, ids_ptr + t * width, scale,
        GROUPS, GROUP_SIZE, KEEP_GROUPS, TOP_K, ALWAYS, NORM, G_PAD, S_PAD, K_PAD,
    )  # fmt: skip


@triton.jit
def _route_token(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, scale,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, KEEP_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr, ALWAYS: tl.constexpr, NORM: tl.constexpr, G_PAD: tl.constexpr,
    S_PAD: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    # One token's choice from its E router logits (fp32) at logits_ptr, as a [G_PAD, S_PAD]
    # tile of groups, every choice a max over the tile. Slot (g, s) is expert g * GROUP_SIZE +
    # s; padding holds -inf and is never chosen. Choices are found by value, ties to the
    # lower expert id. Writes TOP_K + ALWAYS weights and ids.
    g = tl.arange(0, G_PAD)
    s = tl.arange(0, S_PAD)
    ok = (g < GROUPS)[:, None] & (s < GROUP_SIZE)[None, :]
    expert = g[:, None] * GROUP_SIZE + s[None, :]
    # .cg: past L1, as moe_gate_kernel's last program reads logits other programs stored.
    logit = tl.load(logits_ptr + expert, mask=ok, other=0.0, cache_modifier=".cg")
    score = tl.where(ok, tl.sigmoid(logit), 0.0)
    bias = tl.load(bias_ptr + expert, mask=ok, other=0.0)
    biased = tl.where(ok, score + bias, float("-inf"))
    if KEEP_GROUPS < GROUPS:
        # A group's score is the sum of its best two biased scores; keep the best KEEP_GROUPS.
        top1 = tl.max(biased, 1)
        first = tl.min(tl.where(biased == top1[:, None], s[None, :], S_PAD), 1)
        top2 = tl.max(tl.where(s[None, :] == first[:, None], float("-inf"), biased), 1)
        group_score = tl.where(g < GROUPS, top1 + top2, float("-inf"))
        kept = g < 0
        for _ in tl.static_range(KEEP_GROUPS):
            best = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == best, g, G_PAD), 0)
            kept = kept | (g == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        biased = tl.where(kept[:, None], biased, float("-inf"))
    j = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.int64)
    weight = tl.zeros([K_PAD], dtype=tl.float32)
    # One max a choice: each slot's key is its biased score's bits made to order as the
    # floats do (negative ones' magnitude bits flipped), above the complement of its expert
    # id, so the largest key is the best score, ties to the lower id.
    bits = biased.to(tl.int32, bitcast=True)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
    key = (order << 32) | (0xFFFFFFFF - expert.to(tl.int64))
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(key, 1), 0)
        pick = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        # The weight is the unbiased score (the bias only chooses), from its logit again.
        w = tl.sigmoid(tl.load(logits_ptr + pick, cache_modifier=".cg"))
        chosen = tl.where(j == i, pick, chosen)
        weight = tl.where(j == i, w, weight)
        key = tl.where(key == best, -(2**63), key)
    if NORM:
        weight = weight / (tl.sum(weight, 0) + 1e-20)
    weight = weight * scale
    # Then the ALWAYS experts every token uses, after the routed ones, with weight 1.
    weight = tl.where(j < TOP_K, weight, 1.0)
    chosen = tl.where(j < TOP_K, chosen, GROUPS * GROUP_SIZE + j - TOP_K)
    width = TOP_K + ALWAYS
    tl.store(weights_ptr + j, weight, mask=j < width)
    tl.store(ids_ptr + j, chosen, mask=j < width)


@triton.jit
def moe_layout_kernel(
    ids_ptr, layout_ptr, starts_ptr, rows, slots,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr, FILL: tl.constexpr, FILLS: tl.constexpr,
):  # fmt: skip
    # One program (the whole layout depends on every row).
    _layout(ids_ptr, layout_ptr, starts_ptr, rows, slots, E, E_PAD, BLOCK_M, CHUNK, CHUNKS,
            FILL, FILLS)  # fmt: skip


@triton.jit
def _layout(
    ids_ptr, layout_ptr, starts_ptr, rows, slots,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr, FILL: tl.constexpr, FILLS: tl.constexpr,
):  # fmt: skip
    # starts_ptr: [E_PAD] int32 scratch, each expert's next free slot. Rows are read CHUNK at
    # a time; bin E counts the padding of the last chunk (E_PAD > E) and is never placed.
    # 1. Rows per expert -> blocks per expert -> each expert's first slot.
    bins = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(CHUNKS):
        r = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < rows, other=E).to(tl.int32)
        counts += tl.histogram(e, E_PAD)
    blocks = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tl.store(starts_ptr + bins, (tl.cumsum(blocks, 0) - blocks) * BLOCK_M)
    # 2. Every slot padding until a row takes it.
    for c in range(FILLS):
        f = c * FILL + tl.arange(0, FILL)
        tl.store(layout_ptr + f, tl.full([FILL], -1, tl.int32), mask=f < slots)
    tl.debug_barrier()
    # 3. Each row to its expert's next slot, in row order (a stable sort): its rank among the
    # chunk's earlier rows of the same expert, past what earlier chunks placed.
    before = tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None]
    for c in range(CHUNKS):
        r = c * CHUNK + tl.arange(0, CHUNK)
        real = r < rows
        e = tl.load(ids_ptr + r, mask=real, other=E).to(tl.int32)
        rank = tl.sum(((e[:, None] == e[None, :]) & before).to(tl.int32), 1)
        start = tl.load(starts_ptr + e, mask=real, other=0)
        tl.store(layout_ptr + start + rank, r.to(tl.int32), mask=real)
        placed = tl.load(starts_ptr + bins) + tl.histogram(e, E_PAD)
        tl.debug_barrier()
        tl.store(starts_ptr + bins, placed)
        tl.debug_barrier()


@triton.jit
def moe_gate_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, count_ptr, weights_ptr, ids_ptr, layout_ptr,
    starts_ptr, stride_x, scale, slots, tokens,
    T: tl.constexpr, H: tl.constexpr, EB: tl.constexpr, BK: tl.constexpr,
    PROGRAMS: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    KEEP_GROUPS: tl.constexpr, TOP_K: tl.constexpr, ALWAYS: tl.constexpr, NORM: tl.constexpr,
    G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, E_SLOTS: tl.constexpr,
    E_SLOTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr, FILL: tl.constexpr, FILLS: tl.constexpr, LAYOUT: tl.constexpr,
):  # fmt: skip
    # A MoE layer's router for `tokens` <= T tokens in one launch (T a power of two: a few
    # compilations serve every step size). Program p computes the logits of
    # experts [p EB, (p + 1) EB) for every token (fp32 products and sums, each token's sum in
    # the same order whatever T is) into logits_ptr [T, E]; the program that finishes last
    # (count_ptr, an int32 zero between launches, which it puts back) routes every token as
    # moe_route_kernel and lays their rows out as moe_layout_kernel.
    p = tl.program_id(0)
    experts = GROUPS * GROUP_SIZE
    e = p * EB + tl.arange(0, EB)
    e_ok = e < experts
    k = tl.arange(0, BK)
    for t in range(T):
        acc = tl.zeros([EB, BK], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + k
            x = tl.load(x_ptr + t * stride_x + kk, mask=(kk < H) & (t < tokens), other=0.0)
            x = x.to(tl.float32)
            w = tl.load(
                w_ptr + e[:, None] * H + kk[None, :],
                mask=e_ok[:, None] & (kk < H)[None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += w * x[None, :]
        tl.store(logits_ptr + t * experts + e, tl.sum(acc, 1), mask=e_ok & (t < tokens))
    tl.debug_barrier()  # every thread's logits stored before the count says so
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if done == PROGRAMS - 1:
        tl.store(count_ptr, 0)
        tl.debug_barrier()
        width = TOP_K + ALWAYS
        for t in range(T):  # (a runtime bound trips the CPU interpreter)
            if t < tokens:
                _route_token(
                    logits_ptr + t * experts, bias_ptr, weights_ptr + t * width,
                    ids_ptr + t * width, scale, GROUPS, GROUP_SIZE, KEEP_GROUPS, TOP_K, ALWAYS,
                    NORM, G_PAD, S_PAD, K_PAD,
                )  # fmt: skip
        if LAYOUT:  # (experts that read none, INT4's GEMV, skip it)
            tl.debug_barrier()
            _layout(ids_ptr, layout_ptr, starts_ptr, tokens * width, slots, E_SLOTS,
                    E_SLOTS_PAD, BLOCK_M, CHUNK, CHUNKS, FILL, FILLS)  # fmt: skip


@triton.jit
def moe_combine_kernel(
    rows_ptr, weights_ptr, add_ptr, out_ptr, n, stride_rows, stride_add, stride_out,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (t, j): token t's columns [j BLOCK, (j + 1) BLOCK). Its TOP_K expert rows times
    # their weights summed in fp32 in choice order, rounded to the output dtype; with HAS_ADD
    # that rounded sum plus add[t], rounded again (as `routed + shared` in torch rounds).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        w = tl.load(weights_ptr + t * TOP_K + i)
        row = tl.load(rows_ptr + (t * TOP_K + i) * stride_rows + cols, mask=ok, other=0.0)
        acc += row.to(tl.float32) * w
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        add = tl.load(add_ptr + t * stride_add + cols, mask=ok, other=0.0)
        out = (out.to(tl.float32) + add.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + cols, out, mask=ok)


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, ids_ptr, rows_ptr, out_ptr, n,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    K: tl.constexpr, ROWS_PER_A: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
    DOT_F32: tl.constexpr, DEQUANT: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (b, j): block b of the expert-sorted layout (BLOCK_M row ids, all one expert's,
    # padded with -1; see moe_fused.moe_layout_no_sync) times that expert's j-th BLOCK_N output
    # columns. Each weight tile is read once per block and multiplied with tl.dot against the
    # block's gathered activation rows (row r reads a[r // ROWS_PER_A]); fp32 accumulation.
    # W is [E, N, K] values (INT4 False), or INT4 packed [E, N, ceil(K / 8)] int32 words
    # (element 8w + i in bits 4i..4i+3, nibble q + 8) with scales [E, N, ceil(K / GROUP)]:
    # each word is loaded once and unpacked in registers, q * scale in fp32, then rounded to
    # a's dtype for the dot (as the reference rounds its dequantized weight). DOT_F32: the dot
    # takes fp32 operands with full fp32 products (fp32 activations: not TF32's 10-bit
    # mantissa; the CPU interpreter: its dot reads bf16 as raw integers). Products of values
    # already rounded to a's dtype are exact in fp32, so only the order of the sums changes.
    # DEQUANT, how INT4 nibbles become weights: 0 fp32 arithmetic (the interpreter, fp16 or
    # fp32 activations), 1 bf16 bit tricks an element, 2 PTX bf16x2 pairs (bf16 on CUDA, a
    # word's eight inputs in one scale group); all three give the same bf16 weights.
    # K is a constexpr: a model has two (hidden, intermediate), so two compilations; a runtime
    # loop bound also trips the CPU interpreter under numpy 2.
    b = tl.program_id(0)
    first = tl.load(rows_ptr + b * BLOCK_M)
    if first < 0:  # past the step's real blocks (the grid is sized for the worst routing)
        return
    e = tl.load(ids_ptr + first).to(tl.int64)
    rows = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = rows >= 0
    rows = tl.where(m_ok, rows, 0).to(tl.int64)
    a_rows = a_ptr + (rows // ROWS_PER_A) * stride_a  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < n
    w_cols = w_ptr + e * stride_we + cols.to(tl.int64) * stride_wn  # [BLOCK_N]
    s_cols = s_ptr + e * stride_se + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # GATED: the weight holds gate rows [0, n) then up rows [n, 2n); a second accumulator takes
    # the up rows of the same columns, and the epilogue stores silu(gate) * up.
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _moe_tile_dot(
            a_rows, m_ok, acc, w_cols, s_cols, k0, n_ok, K, INT4, GROUP, DOT_F32, DEQUANT,
            BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if GATED:
            up = _moe_tile_dot(
                a_rows, m_ok, up, w_cols + n * stride_wn, s_cols + n * stride_sn, k0, n_ok, K,
                INT4, GROUP, DOT_F32, DEQUANT, BLOCK_K, BLOCK_N,
            )  # fmt: skip
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:  # rounded where the two-kernel path rounds: both halves, then silu's output
        g = acc.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    tl.store(out, acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_tile_dot(
    a_rows, m_ok, acc, w_cols, s_cols, k0, n_ok,
    K: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr,
    DEQUANT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # acc + a @ the weight tile: the BLOCK_K inputs from k0 of the rows at a_rows, the BLOCK_N
    # columns at w_cols.
    if INT4:
        # Word w holds inputs 8w .. 8w + 7, nibble i input 8w + i. Rather than interleave the
        # nibbles into K order in registers (a costly relayout), the product is split by
        # nibble: eight dots of K = BLOCK_K / 8, a[:, 8w + i] @ q_i[w, :]. Past K the
        # activations are 0, so whatever padding nibbles or masked scales hold adds 0.
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ok = (kw < (K + 7) // 8)[:, None] & n_ok[None, :]
        words = tl.load(w_cols[None, :] + kw[:, None], mask=ok, other=0)  # [BLOCK_K / 8, N]
        if GROUP % 8 == 0:  # a word's eight inputs share one scale group
            scale = tl.load(s_cols[None, :] + (kw * 8 // GROUP)[:, None], mask=ok, other=0.0)
        if DEQUANT == 2:  # two words a PTX call, nibble i of both as one bf16x2 lane pair
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                _DEQUANT_PAIRS, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scale.to(tl.bfloat16)],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
            )  # fmt: skip
            acc = _nibble_dot(a_rows, m_ok, kw, 0, w0, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 1, w1, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 2, w2, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 3, w3, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 4, w4, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 5, w5, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 6, w6, acc, K, DOT_F32)
            acc = _nibble_dot(a_rows, m_ok, kw, 7, w7, acc, K, DOT_F32)
        else:
            for i in tl.static_range(8):
                ks = kw * 8 + i
                a = tl.load(a_rows[:, None] + ks[None, :],
                            mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
                if GROUP % 8 != 0:
                    scale = tl.load(s_cols[None, :] + (ks // GROUP)[:, None], mask=ok, other=0.0)
                # Arithmetic shift of a negative word drags the sign in; the mask drops it.
                nibble = (words >> (4 * i)) & 0xF
                if DEQUANT == 1:
                    # 0x4300 | q is the bfloat16 of 128 + q: the nibble becomes a bf16 with no
                    # integer conversion, 136 off q - 8 exactly. q * scale is exact before its
                    # one rounding to bf16, as the fp32 product rounded to bf16 is.
                    q = (nibble | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
                    w = q.to(tl.bfloat16) * scale.to(tl.bfloat16)
                else:
                    w = ((nibble - 8).to(tl.float32) * scale.to(tl.float32)).to(a.dtype)
                acc = _dot(a, w, acc, DOT_F32)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_cols[None, :] + ks[:, None], mask=ok, other=0.0).to(a.dtype)
        acc = _dot(a, w, acc, DOT_F32)
    return acc


# Two INT4 words ($8, $9) and their bf16 scales ($10, packed) in, nibble i of both words as
# bf16 (q - 8) * scale out in $i (word $8's in the low half). prmt gathers the two words' low
# halves (nibbles 0-3) into `lo` and high halves (4-7) into `hi`, so one shift, and, or reaches
# the same nibble of both; 0x4300 | q is the bfloat16 of 128 + q, the first fma (x 1, - 136)
# gives q - 8 exactly, the second the product rounded once, as the fp32 product rounded to
# bf16 is (adding -0 leaves every product, zeros included, as it is). 34 instructions for 16
# weights, where the per-element path takes about ten an element.
_DEQUANT_PAIRS = tl.constexpr(
    """{
.reg .b32 lo, hi, t, one, off, nz;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
mov.b32 nz, 0x80008000;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
"""
    + "".join(
        f"""shr.u32 t, {half}, {4 * (i % 4)};
and.b32 t, t, 0x000F000F;
or.b32 t, t, 0x43004300;
fma.rn.bf16x2 t, t, one, off;
fma.rn.bf16x2 ${i}, t, $10, nz;
"""
        for i, half in enumerate(["lo"] * 4 + ["hi"] * 4)
    )
    + "}"
)


@triton.jit
def _nibble_dot(a_rows, m_ok, kw, i: tl.constexpr, w, acc, K: tl.constexpr,
                DOT_F32: tl.constexpr):  # fmt: skip
    # acc + the activations of inputs 8 kw + i @ w, nibble i's dequantized weights.
    ks = kw * 8 + i
    a = tl.load(a_rows[:, None] + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
    return _dot(a, w, acc, DOT_F32)


@triton.jit
def _dot(a, w, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def moe_gemv_kernel(
    a_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, n,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    K: tl.constexpr, ROWS_PER_A: tl.constexpr, GROUP: tl.constexpr, DEQUANT: tl.constexpr,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Program (r, j): row r of the product, a[r // ROWS_PER_A] @ W[ids[r]]^T, its j-th BLOCK_N
    # output columns, for INT4 weights (as moe_gemm_kernel's, a word's eight inputs in one
    # scale group) and few rows: each row streams its expert's words itself, on the CUDA
    # cores, where a tensor-core tile of 16 rows would hold one real row and pass every
    # dequantized weight through shared memory to reach the MMA's operand layout. The
    # weights are rounded to a's dtype as moe_gemm_kernel rounds them, the products taken in
    # fp32 (exact) and summed per column in fp32: [BLOCK_K / 8, BLOCK_N] partial sums over K,
    # then one sum over their rows. GATED: gate and up columns, silu(gate) * up stored.
    r = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + r).to(tl.int64)
    a_row = a_ptr + (r // ROWS_PER_A) * stride_a
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < n
    w_cols = w_ptr + e * stride_we + cols.to(tl.int64) * stride_wn
    s_cols = s_ptr + e * stride_se + cols.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        acc = _gemv_tile(a_row, acc, w_cols, s_cols, kw, n_ok, K, GROUP, DEQUANT)
        if GATED:
            up = _gemv_tile(a_row, up, w_cols + n * stride_wn, s_cols + n * stride_sn, kw, n_ok,
                            K, GROUP, DEQUANT)  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    out = tl.sum(acc, axis=0)
    if GATED:  # rounded where moe_gemm_kernel rounds
        g = out.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = act * tl.sum(up, axis=0).to(dtype).to(tl.float32)
    tl.store(out_ptr + r * stride_out + cols, out.to(dtype), mask=n_ok)


@triton.jit
def _gemv_tile(a_row, acc, w_cols, s_cols, kw, n_ok, K: tl.constexpr, GROUP: tl.constexpr,
               DEQUANT: tl.constexpr):  # fmt: skip
    # acc + the products of words kw (all eight nibbles) with their inputs, per (word, column).
    ok = (kw < (K + 7) // 8)[:, None] & n_ok[None, :]
    words = tl.load(w_cols[None, :] + kw[:, None], mask=ok, other=0)  # [BLOCK_K / 8, N]
    scale = tl.load(s_cols[None, :] + (kw * 8 // GROUP)[:, None], mask=ok, other=0.0)
    if DEQUANT == 2:
        w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
            _DEQUANT_PAIRS, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scale.to(tl.bfloat16)],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
        )  # fmt: skip
        acc += _gemv_nibble(a_row, kw, 0, w0, K)
        acc += _gemv_nibble(a_row, kw, 1, w1, K)
        acc += _gemv_nibble(a_row, kw, 2, w2, K)
        acc += _gemv_nibble(a_row, kw, 3, w3, K)
        acc += _gemv_nibble(a_row, kw, 4, w4, K)
        acc += _gemv_nibble(a_row, kw, 5, w5, K)
        acc += _gemv_nibble(a_row, kw, 6, w6, K)
        acc += _gemv_nibble(a_row, kw, 7, w7, K)
    else:
        for i in tl.static_range(8):
            nibble = (words >> (4 * i)) & 0xF
            a_dtype = a_row.dtype.element_ty
            w = ((nibble - 8).to(tl.float32) * scale.to(tl.float32)).to(a_dtype)
            acc += _gemv_nibble(a_row, kw, i, w, K)
    return acc


@triton.jit
def _gemv_nibble(a_row, kw, i: tl.constexpr, w, K: tl.constexpr):
    # The products of nibble i's weights w [BLOCK_K / 8, N] with inputs 8 kw + i, in fp32.
    ks = kw * 8 + i
    a = tl.load(a_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    return a[:, None] * w.to(tl.float32)
