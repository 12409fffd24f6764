"""Fused MoE kernels for CUDA: a DeepSeek-V3 MoE layer's routing, expert layout, grouped
GEMMs and the weighted sum of each token's expert outputs, each one launch with no host read
(graph-safe), where the torch ops they replace take ten to twenty small kernels each.

    logits [T, E] --moe_route_no_sync--> weights [T, top_k] fp32, ids [T, top_k]
    ids --moe_layout_no_sync--> layout: the rows (token, choice) sorted by expert into blocks
    x [T, H] --moe_gemm (gate_up, gated: silu(gate) * up)--> [R, I] --moe_gemm (down)--> [R, H]
      --moe_combine (x weights, summed per token, + the shared experts' output)--> [T, H]

Each has a torch reference (layers/moe.py's router and loop, moe_layout_reference); the CPU
suite checks the kernels against them under TRITON_INTERPRET=1. `fused.use_fused(x)` says
where the kernels serve.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from outrider import env
from outrider.layers import fused

# Activation dtypes moe_gemm takes (it computes in fp32 and rounds its output to a's dtype).
MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def moe_gemm_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether moe_gemm returns a result (not None) for activations of `dtype` on `device`
    when serving (autograd off): known before any forward, so a model can say whether its
    MoE reads the host (graph_safe)."""
    return (
        device.type == "cuda" and dtype in MOE_DTYPES and env.fused_kernels() and fused.triton_ok()
    )


# moe_gemm's rows a block: one expert's, 16 being tl.dot's least.
MOE_BLOCK_M = 16


@dataclass(frozen=True)
class MoeTile:
    """moe_gemm's launch shape: BLOCK_N output columns and a BLOCK_K slice of K a step, the
    warps and software-pipeline stages of a program. INT4 needs block_k >= 128 (its dots take
    K = block_k / 8, 16 at least)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def moe_tile(rows: int, int4: bool, gated: bool) -> MoeTile:
    """The launch shape for `rows` rows (tokens x choices), from the H200 sweep in
    benchmarks/results/moe_gemm_tiles.json: bf16 experts stream at 85-100% of copy bandwidth
    from one token up with narrow gated tiles and, at few rows, wide down tiles of four stages;
    INT4 experts, bound by unpacking, gain most from long K slices."""
    if int4:
        return MoeTile(64, 256, 4, 3)
    if gated:  # one token's rows: three stages, 1.7 us a layer faster on the H200
        return MoeTile(32, 128, 4, 3 if rows <= 8 else 4)
    return MoeTile(128, 128, 4, 4) if rows <= 32 else MoeTile(64, 128, 4, 3)


# The layout kernel places _LAYOUT_CHUNK rows at a time (each row's rank among its chunk is a
# [chunk, chunk] comparison) and pads _LAYOUT_FILL slots at a time.
_LAYOUT_CHUNK, _LAYOUT_FILL = 64, 1024


def moe_layout_slots(rows: int, num_experts: int) -> int:
    """Length of the layout for `rows` rows over `num_experts` experts: the most blocks any
    routing needs, times MOE_BLOCK_M. At most min(E, R) experts have rows, each with at most
    MOE_BLOCK_M - 1 padding slots, so sum(ceil(rows_e / M)) <= (R + min(E, R)(M - 1)) / M
    (8 rows: 8 blocks, not Kimi's 384 experts' worth). Depends on shapes only, so the kernel's
    grid is the same for every routing (graph-safe)."""
    used = min(num_experts, rows)
    return (rows + used * (MOE_BLOCK_M - 1)) // MOE_BLOCK_M * MOE_BLOCK_M


def moe_layout_no_sync(
    ids: torch.Tensor,  # [R] int: the expert each row uses
    num_experts: int,
) -> torch.Tensor:  # [moe_layout_slots(R, num_experts)] int32 row ids, -1 where padding
    """The rows grouped by expert in blocks of MOE_BLOCK_M: each block holds one expert's rows
    (ascending, as a stable sort leaves them) then -1s, the experts' blocks in expert order,
    then all -1 blocks up to the static length (moe_layout_reference's worked example). One
    launch where the fused path serves, else the reference's torch ops; neither reads the
    host."""
    if not fused.use_fused(ids):
        return moe_layout_reference(ids, num_experts)
    rows = ids.numel()
    slots = moe_layout_slots(rows, num_experts)
    layout = torch.empty(slots, dtype=torch.int32, device=ids.device)
    if not rows:
        return layout
    e_pad = _kernels().next_pow2(num_experts + 1)  # one bin more: the last chunk's padding
    starts = torch.empty(e_pad, dtype=torch.int32, device=ids.device)
    # Loop counts are compile-time (the interpreter takes no runtime bound), rounded up to a
    # power of two so that every step size shares one of a few compilations.
    _kernels().moe_layout_kernel[(1,)](
        ids.reshape(-1), layout, starts, rows, slots,
        E=num_experts, E_PAD=e_pad, BLOCK_M=MOE_BLOCK_M, CHUNK=_LAYOUT_CHUNK,
        CHUNKS=_kernels().next_pow2(-(-rows // _LAYOUT_CHUNK)), FILL=_LAYOUT_FILL,
        FILLS=_kernels().next_pow2(-(-slots // _LAYOUT_FILL)), num_warps=4,
    )  # fmt: skip
    return layout


def moe_layout_reference(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """moe_layout_no_sync in torch ops (about 16 kernels on CUDA).

    Worked example, MOE_BLOCK_M 4 for short, ids = [2, 0, 2, 2, 2, 0] (E 3):
        order (stable sort)  [1, 5, 0, 2, 3, 4]   sorted ids [0, 0, 2, 2, 2, 2]
        rows per expert      [2, 0, 4]  -> blocks [1, 0, 1], first block [0, 1, 1]
        slot of sorted i     block_start[e] * 4 + (i - row_start[e]) = [0, 1, 4, 5, 6, 7]
        layout               [1, 5, -1, -1,  0, 2, 3, 4,  -1, ...]
    An expert with no rows has no block; a block's expert is that of its first row."""
    rows = ids.numel()
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    bounds = torch.searchsorted(sorted_ids, experts)  # [E + 1]: expert e's sorted rows' start
    blocks = (bounds.diff() + MOE_BLOCK_M - 1) // MOE_BLOCK_M  # [E]
    block_start = blocks.cumsum(0) - blocks
    rank = torch.arange(rows, device=ids.device) - bounds[sorted_ids]
    slot = block_start[sorted_ids] * MOE_BLOCK_M + rank
    layout = torch.full(
        (moe_layout_slots(rows, num_experts),), -1, dtype=torch.int32, device=ids.device
    )
    return layout.scatter_(0, slot, order.to(torch.int32))


def moe_gemm(
    a: torch.Tensor,  # [R / rows_per_a, K]: row r of the product reads a[r // rows_per_a]
    ids: torch.Tensor,  # [R] int: the expert each row uses
    weight: torch.Tensor,  # [E, N, K] values, or INT4 packed [E, N, ceil(K / 8)] int32
    rows_per_a: int = 1,
    scale: torch.Tensor | None = None,  # INT4: [E, N, ceil(K / group_size)]
    group_size: int = 0,
    layout: torch.Tensor | None = None,  # moe_layout_no_sync(ids, E), to share between calls
    gated: bool = False,
    tile: MoeTile | None = None,  # None: moe_tile's choice
) -> torch.Tensor | None:  # [R, N] in a's dtype; gated: [R, N / 2]
    """Row r of the result is a[r // rows_per_a] @ weight[ids[r]]^T, with no host read
    (graph-safe): rows_per_a = top_k lets a token's top_k rows share its activation row.
    gated: the weight's rows are gate then up (a SwiGLU expert's gate_up) and the result is
    silu(gate) * up, rounded as the product and SiluAndMul round it, from one launch.
    With `scale`, `weight` is compressed-tensors INT4 (loaders/compressed_tensors.py),
    dequantized in registers as q * scale rounded to a's dtype before the multiply, as the
    reference rounds its dequantized weight (for bf16 activations the product is taken in bf16,
    exact before its one rounding). Accumulates in fp32. None where the fused path does not
    serve.

    A grouped GEMM: the rows are sorted by expert into blocks of MOE_BLOCK_M
    (moe_layout_no_sync, one launch; pass `layout` to reuse one across the two GEMMs of a
    MoE layer), then one launch over (blocks, N / block_n) reads each expert's weight tile
    once per block of its rows and multiplies on tensor cores (tl.dot). The grid is sized for
    the worst routing from R and E alone; blocks past the real count exit at once. With few
    rows every block holds one real row and the kernel streams the chosen experts' weights."""
    if not fused.use_fused(a) or a.dtype not in MOE_DTYPES:
        return None
    a = a if a.stride(-1) == 1 else a.contiguous()
    ids = ids.reshape(-1).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    int4 = scale is not None
    width = a.shape[1]
    if not int4 and weight.shape[-1] != width:
        raise ValueError(f"moe_gemm: activations of width {width} against weights {weight.shape}")
    if int4:
        if weight.shape[-1] != -(-width // 8) or group_size < 1:
            raise ValueError(
                f"moe_gemm: INT4 activations of width {width} need packed weights of "
                f"{-(-width // 8)} words per row and a group size >= 1, got {tuple(weight.shape)}"
                f" and group_size={group_size}"
            )
        scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    else:
        scale = weight  # unread
    rows, n, experts = ids.numel(), weight.shape[1], weight.shape[0]
    if gated:
        if n % 2:
            raise ValueError(f"moe_gemm: gated weights {tuple(weight.shape)} need an even N")
        n //= 2
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if not rows:
        return out
    if int4 and tile is None and gemv_serves(rows, group_size):  # no layout read
        return _moe_gemv(a, ids, weight, rows_per_a, scale, group_size, gated, out)
    if layout is None:
        layout = moe_layout_no_sync(ids, experts)
    elif layout.numel() != moe_layout_slots(rows, experts):
        raise ValueError(
            f"moe_gemm: a layout of {layout.numel()} slots for {rows} rows over {experts} "
            f"experts, which need {moe_layout_slots(rows, experts)}: build it with "
            f"moe_layout_no_sync(ids, {experts})"
        )
    tile = tile or moe_tile(rows, int4, gated)
    if int4 and tile.block_k < 128:
        raise ValueError(f"moe_gemm: INT4 weights need a tile's block_k >= 128, not {tile}")
    grid = (layout.numel() // MOE_BLOCK_M, -(-n // tile.block_n))
    _kernels().moe_gemm_kernel[grid](
        a, weight, scale, ids, layout, out, n,
        a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0),
        K=width, ROWS_PER_A=rows_per_a, INT4=int4, GROUP=max(group_size, 1),
        DOT_F32=a.dtype == torch.float32 or not a.is_cuda,  # not CUDA: the interpreter
        DEQUANT=_dequant(a, group_size), GATED=gated, BLOCK_M=MOE_BLOCK_M,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    return out


# INT4 products of at most this many rows (tokens x choices: 16 tokens of Kimi's 8) run as one
# GEMV a row (moe_gemv): at few rows a block of the grouped GEMM holds one real row, and the
# tensor-core path spends its time moving dequantized weights into the MMA's layout.
MOE_GEMV_MAX_ROWS = 128


def gemv_serves(rows: int, group_size: int) -> bool:
    """Whether moe_gemm runs INT4 weights of `group_size` as moe_gemv at `rows` rows (given no
    tile), which reads no layout."""
    return rows <= MOE_GEMV_MAX_ROWS and group_size % 8 == 0


@dataclass(frozen=True)
class GemvTile:
    """moe_gemv's launch shape: BLOCK_N output columns, a BLOCK_K slice of K a step (>= 8)."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4


def moe_gemv(
    a: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor,  # INT4 packed [E, N, ceil(K / 8)] int32
    rows_per_a: int,
    scale: torch.Tensor,  # [E, N, ceil(K / group_size)]
    group_size: int,
    gated: bool = False,
    tile: GemvTile | None = None,
) -> torch.Tensor | None:
    """moe_gemm's product for INT4 weights, one program per (row, BLOCK_N columns) on the CUDA
    cores: what moe_gemm runs for at most MOE_GEMV_MAX_ROWS rows. The same weights (rounded
    to a's dtype) and fp32 products; the sums' order differs. None where the fused path does
    not serve."""
    width = a.shape[1]
    if weight.shape[-1] != -(-width // 8) or group_size % 8:
        raise ValueError(
            f"moe_gemv: INT4 activations of width {width} need packed weights of "
            f"{-(-width // 8)} words per row and a group size that is a multiple of 8, got "
            f"{tuple(weight.shape)} and group_size={group_size}"
        )
    if not fused.use_fused(a) or a.dtype not in MOE_DTYPES:
        return None
    a = a if a.stride(-1) == 1 else a.contiguous()
    ids = ids.reshape(-1).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    scale = scale if scale.stride(-1) == 1 else scale.contiguous()
    n = weight.shape[1] // 2 if gated else weight.shape[1]
    out = torch.empty(ids.numel(), n, dtype=a.dtype, device=a.device)
    return _moe_gemv(a, ids, weight, rows_per_a, scale, group_size, gated, out, tile)


def gemv_tile(gated: bool) -> GemvTile:
    """moe_gemv's launch shape, from the H100 sweep in
    benchmarks/results/moe_gemm_tiles_gemv_h100.json (Kimi-K2.5's experts at 1, 4 and 16
    tokens): gate_up's two accumulators run best on eight warps (60-68% of copy bandwidth),
    down on four."""
    return GemvTile(64, 256, 8 if gated else 4)


def _moe_gemv(a, ids, weight, rows_per_a, scale, group_size, gated, out, tile=None):
    tile = tile or gemv_tile(gated)
    if not out.shape[0]:
        return out
    n = out.shape[1]
    grid = (out.shape[0], -(-n // tile.block_n))
    _kernels().moe_gemv_kernel[grid](
        a, weight, scale, ids, out, n,
        a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0),
        K=a.shape[1], ROWS_PER_A=rows_per_a, GROUP=group_size, DEQUANT=_dequant(a, group_size),
        GATED=gated, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps,
    )  # fmt: skip
    return out


@functools.cache
def mm_fp32_out(device: torch.device) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32) takes bf16 a and b on `device` (CUDA
    in torch >= 2.8; not the CPU)."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
    try:
        out = torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 8).all())


def moe_route_no_sync(
    x: torch.Tensor,  # [T, H] the MoE block's input
    router: torch.Tensor,  # [E, H] float32 router weight
    bias: torch.Tensor,  # [E] float32 score-correction bias
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scale: float,
    always: int = 0,
    router_bf16: torch.Tensor | None = None,  # [E, H] the router weight, exact in bf16
) -> tuple[torch.Tensor, torch.Tensor]:  # weights, ids: [T, top_k + always] float32, int64
    """DeepSeek-V3's noaux_tc routing: logits x W^T in fp32, then in one launch sigmoid scores,
    the bias added for choosing only, the best topk_group groups by the sum of their two best
    biased scores, the top_k biased experts among them, weighted by their unbiased scores
    (renormalised when norm_topk_prob) times `scale`; then `always` experts E .. E + always - 1
    with weight 1. Choices come in descending biased score, ties to the lower expert id
    (torch's topk leaves both unspecified). The logits' GEMV stays cuBLAS's: in one program
    a token's read of even a 512 KB router (Moonlight's) took 23 us on the H200, four times
    the cast, GEMV and reduce it would replace. With `router_bf16` (x bf16, mm_fp32_out) the
    logits are one GEMM of bf16 inputs with fp32 products, sums and output: the same values
    as the fp32 GEMV up to the order of the sums."""
    t = x.shape[0]
    experts = router.shape[0]
    _check_groups(experts, n_group, topk_group, "moe_route_no_sync")
    size = experts // n_group
    weights = torch.empty(t, top_k + always, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k + always, dtype=torch.int64, device=x.device)
    if not t:
        return weights, ids
    if router_bf16 is not None and x.dtype == torch.bfloat16:
        logits = torch.mm(x, router_bf16.t(), out_dtype=torch.float32)  # [T, E]
    else:
        logits = torch.nn.functional.linear(x.float(), router)
    _kernels().moe_route_kernel[(t,)](
        logits, bias, weights, ids, logits.stride(0), scale,
        GROUPS=n_group, GROUP_SIZE=size, KEEP_GROUPS=topk_group, TOP_K=top_k,
        ALWAYS=always, NORM=norm_topk_prob, G_PAD=_kernels().next_pow2(n_group),
        S_PAD=_kernels().next_pow2(size), K_PAD=_kernels().next_pow2(top_k + always), num_warps=4,
    )  # fmt: skip
    return weights, ids


# moe_gate_no_sync serves steps of at most this many tokens (its last program routes them
# one by one; longer steps route one program per token after cuBLAS's logits GEMM).
GATE_MAX_TOKENS = 16
# Router weights a program of moe_gate_kernel multiplies in registers at once: EB experts x BK.
_GATE_TILE = 8192


def moe_gate_programs(num_experts: int) -> int:
    """Experts per program of moe_gate_kernel: 192 programs for Kimi's 384 experts, 128 for
    DeepSeek-V3's 256, 32 for Moonlight's 64 (at least 2 experts each), each taking its
    experts' router rows in one or two tiles of _GATE_TILE weights: many short programs, where
    fewer walking a row in fourteen small tiles waited on each."""
    return max(2, min(16, _kernels().next_pow2(-(-num_experts // 192))))


def moe_gate_no_sync(
    x: torch.Tensor,  # [T, H], T <= GATE_MAX_TOKENS
    router: torch.Tensor,  # [E, H]: fp32, or its bf16 copy where exact
    bias: torch.Tensor,  # [E] float32 score-correction bias
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scale: float,
    always: int = 0,
    layout: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # weights, ids, layout
    """moe_route_no_sync and then moe_layout_no_sync(ids, E + always) in one launch, logits
    included (`layout` False: no layout, for experts that read none; None in its place):
    each program takes a slice of the experts' logits for every token (fp32
    products and sums: bf16 router weights are exact in fp32 products with bf16 or fp16
    activations), and the last to finish routes the tokens and lays out their rows. Where the
    router's GEMM, its choice and the layout took three launches (about 10 us at one token on
    the H200), this takes one. Each token's logits are summed in an order that depends on
    nothing but the token (batch-invariant); it differs from cuBLAS's."""
    t, width = x.shape[0], top_k + always
    experts, hidden = router.shape
    if t > GATE_MAX_TOKENS:
        raise ValueError(f"moe_gate_no_sync: {t} tokens, past GATE_MAX_TOKENS={GATE_MAX_TOKENS}")
    _check_groups(experts, n_group, topk_group, "moe_gate_no_sync")
    size = experts // n_group
    dev = x.device
    weights = torch.empty(t, width, dtype=torch.float32, device=dev)
    ids = torch.empty(t, width, dtype=torch.int64, device=dev)
    rows, slot_experts = t * width, experts + always
    slots = moe_layout_slots(rows, slot_experts) if layout else 0
    rows_layout = torch.empty(slots, dtype=torch.int32, device=dev)
    if not t:
        return weights, ids, rows_layout if layout else None
    x = x if x.stride(-1) == 1 else x.contiguous()
    router = router if router.is_contiguous() else router.contiguous()
    eb = moe_gate_programs(experts)
    bk = min(_kernels().next_pow2(hidden), _GATE_TILE // eb)
    programs = -(-experts // eb)
    logits = torch.empty(t, experts, dtype=torch.float32, device=dev)
    e_pad = _kernels().next_pow2(slot_experts + 1)
    starts = torch.empty(e_pad, dtype=torch.int32, device=dev)
    k = _kernels()
    k.moe_gate_kernel[(programs,)](
        x, router, bias, logits, _gate_count(dev), weights, ids, rows_layout, starts, x.stride(0),
        scale, slots, t,
        T=k.next_pow2(t), H=hidden, EB=eb, BK=bk, PROGRAMS=programs, GROUPS=n_group, GROUP_SIZE=size,
        KEEP_GROUPS=topk_group, TOP_K=top_k, ALWAYS=always, NORM=norm_topk_prob,
        G_PAD=k.next_pow2(n_group), S_PAD=k.next_pow2(size), K_PAD=k.next_pow2(width),
        E_SLOTS=slot_experts, E_SLOTS_PAD=e_pad, BLOCK_M=MOE_BLOCK_M, CHUNK=_LAYOUT_CHUNK,
        CHUNKS=k.next_pow2(-(-rows // _LAYOUT_CHUNK)), FILL=_LAYOUT_FILL,
        FILLS=k.next_pow2(max(1, -(-slots // _LAYOUT_FILL))), LAYOUT=layout,
        num_warps=8 if eb * bk >= 8192 else 4,
    )  # fmt: skip
    return weights, ids, rows_layout if layout else None


_GATE_COUNTS: dict[torch.device, torch.Tensor] = {}


def _gate_count(device: torch.device) -> torch.Tensor:
    """moe_gate_kernel's arrival count on `device`: one int32, zero between launches (each
    launch's last program puts it back). Launches on one stream never overlap, so every
    layer shares it."""
    count = _GATE_COUNTS.get(device)
    if count is None:
        count = _GATE_COUNTS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return count


def _check_groups(experts: int, n_group: int, topk_group: int, caller: str) -> None:
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"{caller}: {experts} experts in n_group={n_group} groups keeping "
            f"topk_group={topk_group}: n_group must divide the experts and 1 <= topk_group <= "
            f"n_group"
        )
    size = experts // n_group
    if topk_group < n_group and size < 2:
        raise ValueError(f"{caller}: groups of {size} expert(s) have no two best")


def moe_combine(
    rows: torch.Tensor,  # [T * top_k, H] expert outputs, token t's choices at t * top_k + i
    weights: torch.Tensor,  # [T, top_k] float32
    add: torch.Tensor | None = None,  # [T, H] added after the sum (the shared experts')
) -> torch.Tensor:  # [T, H] in rows' dtype
    """sum_i weights[t, i] * rows[t * top_k + i] in fp32, rounded to rows' dtype, then + add
    rounded again: `(rows.view(T, top_k, H).float() * weights[..., None]).sum(1).to(dtype)
    + add` in one launch."""
    t, top_k = weights.shape
    n = rows.shape[-1]
    out = torch.empty(t, n, dtype=rows.dtype, device=rows.device)
    if t:
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        if add is not None and add.stride(-1) != 1:
            add = add.contiguous()
        block = min(1024, _kernels().next_pow2(n))
        _kernels().moe_combine_kernel[(t, -(-n // block))](
            rows, weights.contiguous(), add if add is not None else out, out, n,
            rows.stride(0), add.stride(0) if add is not None else 0, out.stride(0),
            TOP_K=top_k, HAS_ADD=add is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


# moe_gemm's INT4 weights under bf16 activations on CUDA dequantized two words a PTX call
# (moe_kernels._DEQUANT_PAIRS); False: one element at a time (the GPU tests compare the two).
INT4_DEQUANT_PAIRS = True


def _dequant(a: torch.Tensor, group_size: int) -> int:
    # moe_gemm_kernel's DEQUANT: 0 fp32 arithmetic, 1 bf16 bits an element, 2 PTX pairs.
    if a.dtype != torch.bfloat16 or not a.is_cuda:
        return 0
    return 2 if INT4_DEQUANT_PAIRS and group_size % 8 == 0 else 1


@functools.lru_cache(maxsize=1)
def _kernels():
    """Compiled lazily: importing this module never needs triton."""
    from outrider.layers import moe_kernels

    return moe_kernels
