"""Routed mixture of experts, DeepSeek-V3 style: a sigmoid router with group-limited top-k and a
score-correction bias, and the experts' weights stacked into two tensors.

Experts are stored stacked, [E, 2 * I, H] (gate rows then up rows, as HF's fused layout) and
[E, H, I], so that a grouped GEMM over tokens sorted by expert can read them as they are;
checkpoints that store one tensor per expert (`experts.M.gate_proj.weight`) load into their
slice through `weight_loader` with shard id (M, "gate" | "up" | "down").

Tensor parallelism splits every expert rather than the set of experts: each rank holds all E
with I/tp of their intermediate width (I below is a rank's), so the router, whole on every
rank, sends each token to the same experts everywhere and a rank's output is a partial sum.
The caller all-reduces it (DeepSeek-V3's MoE block adds the shared experts' partial sum first:
one all-reduce per layer for both).

Two forwards. The reference: a loop over the experts the step's tokens chose, in expert order
(HF's order, so sums round the same way), which reads the chosen experts on the host; it serves
the CPU and is what the fused path is tested against. The fused path (CUDA, fused.use_fused;
layers/moe_fused.py): every (token, choice) pair is a row, R = T x top_k. The router's choice
is one launch after its logits GEMM; the rows are sorted by expert on the device into blocks of
MOE_BLOCK_M rows of one expert (one launch, once per layer), two `moe_gemm` launches, grouped
GEMMs over those blocks, multiply each block by its expert's weights, read once per block, and
one more sums each token's rows with the shared experts' output; nothing is read on the host
and the forward can be captured in a CUDA graph:

    ids [T, top_k] --sort by expert--> layout [blocks x MOE_BLOCK_M] row ids, -1 padding
    x [T, H] --moe_gemm (row r reads token r // top_k; gate and up, silu(gate) * up)--> [R, I]
      --moe_gemm (row r)--> down [R, H] --x router weights, sum per token, + add--> [T, H]

It rounds differently from the reference: each token's top_k outputs are summed once in fp32
(the reference adds them to the output in x's dtype, one expert at a time), and the GEMMs sum
in another order. It serves steps of at most FUSED_MAX_TOKENS tokens; longer prefill chunks
keep the loop's per-expert GEMMs.

`Int4FusedExperts` holds INT4 weight-only experts (compressed-tensors "pack-quantized", see
loaders/compressed_tensors.py) as they are stored: packed int32 [E, 2I, H/8] and [E, H, I/8]
with per-group scales [E, 2I, H/g] and [E, H, I/g], a quarter of bf16's memory. Its reference
forward dequantizes each chosen expert when it runs; the fused path's W4A16 kernel reads the
packed form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outrider.distributed import TPGroup, single
from outrider.layers import fused, moe_fused
from outrider.layers.activation import SiluAndMul
from outrider.loaders.compressed_tensors import PACK, dequantize_int4, split_unit

# Steps up to this many tokens take the fused path on CUDA. Decode and verify steps sit below
# it (the default graphs' largest step: 64 sequences x (1 + 4 drafts) = 320 tokens; a graph
# captured above it would meet the loop's host read); above it a step is a prefill chunk,
# where the loop's host read is cheap beside its per-expert GEMMs, and the grouped kernel's
# small fixed tiles (moe_fused.MOE_BLOCK_M 16 rows) are not tuned for long ones.
FUSED_MAX_TOKENS = 1024


class GroupedTopkRouter(nn.Module):
    """Which experts each token uses, with what weight (DeepSeek-V3's `noaux_tc` router).

    1. scores = sigmoid(x W^T), in float32 (the router weight stays float32 in every dtype).
    2. For choosing only, add the per-expert correction bias (load balancing without a loss);
       the weights later come from the unbiased scores.
    3. Split the experts into n_group equal groups, score each group by the sum of its best
       two biased scores, keep the best topk_group groups.
    4. Take the top_k biased scores among the kept groups' experts.
    5. Weights: their unbiased scores, divided by their sum when norm_topk_prob (+1e-20 as the
       reference), times routed_scaling_factor.
    6. Then `always` experts every token uses (the shared experts held beside the routed
       ones, ids E .. E + always - 1) with weight 1.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        always: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.always = num_experts, top_k, always
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        f32 = dict(dtype=torch.float32)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, **f32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, **f32), requires_grad=False
        )
        # The weight in bf16 where that loses nothing (checkpoints store the router in bf16),
        # on a device whose GEMM takes bf16 in and gives fp32 out (moe_fused.mm_fp32_out):
        # bf16 activations' logits then come from one GEMM, with fp32 products and sums as the
        # fp32 GEMV, instead of a cast, a GEMV and its reduce.
        self.weight_bf16: torch.Tensor | None = None

    def after_load(self) -> None:
        w = self.weight
        low = w.to(torch.bfloat16)
        exact = bool(torch.equal(low.float(), w))
        self.weight_bf16 = low if exact and moe_fused.mm_fp32_out(w.device) else None

    def route(
        self, x: torch.Tensor, layout: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """forward's weights and ids, and where the fused kernels serve a step of at most
        moe_fused.GATE_MAX_TOKENS tokens, the layout of their rows over the E + always
        experts (moe_layout_no_sync's), all from one launch with the logits; else None (and
        None when `layout` is False: experts that read none)."""
        if fused.use_fused(x) and x.shape[0] <= moe_fused.GATE_MAX_TOKENS:
            low = self.weight_bf16 is not None and x.dtype in (torch.bfloat16, torch.float16)
            return moe_fused.moe_gate_no_sync(
                x, self.weight_bf16 if low else self.weight, self.e_score_correction_bias,
                self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                self.routed_scaling_factor, self.always, layout,
            )  # fmt: skip
        weights, ids = self(x)
        return weights, ids, None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, top_k + always] float32, expert ids [T, top_k + always]
        int64. Where the fused kernels serve, steps 1-6 after the logits' GEMV are one launch
        (choices then come in descending biased score, ties to the lower id); else these torch
        ops."""
        if fused.use_fused(x):
            low = self.weight_bf16 if x.dtype == torch.bfloat16 else None
            return moe_fused.moe_route_no_sync(
                x, self.weight, self.e_score_correction_bias, self.top_k, self.n_group,
                self.topk_group, self.norm_topk_prob, self.routed_scaling_factor, self.always,
                router_bf16=low,
            )  # fmt: skip
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        grouped = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(self.num_experts // self.n_group, dim=1)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices  # [T, top_k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        if self.always:
            t = ids.shape[0]
            shared = torch.arange(self.num_experts, self.num_experts + self.always, device=x.device)
            ids = torch.cat([ids, shared.expand(t, -1)], dim=1)
            weights = torch.cat([weights, weights.new_ones(t, self.always)], dim=1)
        return weights, ids


class FusedExperts(nn.Module):
    """E SwiGLU experts in two stacked tensors; forward(x, weights, ids) sums each token's
    chosen experts' outputs times their weights.

    Under tensor parallelism every rank holds every expert with its intermediate dimension
    split: rank r keeps rows [r I/tp, (r + 1) I/tp) of each expert's gate and of its up
    projection, and the same columns of its down projection, so the forward returns this
    rank's partial sum, which the caller all-reduces (once, with the shared experts')."""

    _ROWS = {"gate": 0, "up": 1}

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        tp: TPGroup | None = None,
        num_shared: int = 0,
    ) -> None:
        """num_shared: shared experts (DeepSeek-V3's `shared_experts`, an MLP of width
        num_shared x intermediate) held as num_shared more experts of width `intermediate`
        after the routed ones, ids E .. E + num_shared - 1, so that the grouped GEMMs run them
        with the routed experts (the router names them for every token: its `always`). A
        checkpoint's shared MLP loads into them with shard id ("shared", part)."""
        super().__init__()
        self._init_split(num_experts, intermediate, tp)
        self.num_shared = num_shared
        i, stacked = self.intermediate, num_experts + num_shared
        self.gate_up_proj = nn.Parameter(
            torch.empty(stacked, 2 * i, hidden), requires_grad=False
        )  # [E + S, 2 * I/tp, H]
        self.down_proj = nn.Parameter(
            torch.empty(stacked, hidden, i), requires_grad=False
        )  # [E + S, H, I/tp]
        self._register_loaders(("gate_up_proj",), ("down_proj",))
        self.act = SiluAndMul()

    def _init_split(self, num_experts: int, intermediate: int, tp: TPGroup | None) -> None:
        tp = tp or single()
        if intermediate % tp.size:
            raise ValueError(
                f"moe_intermediate_size {intermediate} does not split over tensor-parallel "
                f"size {tp.size}: pick a tensor-parallel size that divides {intermediate}"
            )
        self.num_experts, self.tp_rank, self.tp_size = num_experts, tp.rank, tp.size
        self.intermediate = intermediate // tp.size  # this rank's
        self.num_shared = 0

    def _register_loaders(self, gate_up: tuple[str, ...], down: tuple[str, ...]) -> None:
        # Every expert's shards must arrive (models/weights.py checks `expected_shards`), or
        # the whole stacked tensor at once (shard None).
        for names, parts in ((gate_up, ("gate", "up")), (down, ("down",))):
            for name in names:
                param = getattr(self, name)
                param.weight_loader = self.weight_loader
                param.expert_parts = parts
                param.expected_shards = [(e, p) for e in range(self.num_experts) for p in parts]
                if self.num_shared:
                    param.expected_shards += [("shared", p) for p in parts]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None = None
    ) -> None:
        if shard_id is None:  # the whole stack: [E, gate rows then up rows, ...] or [E, ...]
            if loaded.shape[0] != self.num_experts:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint stack of shape {tuple(loaded.shape)} "
                    f"holds {loaded.shape[0]} experts, not the config's n_routed_experts="
                    f"{self.num_experts}: the checkpoint does not match its config.json"
                )
            parts = param.expert_parts
            for e in range(self.num_experts):
                for i, part in enumerate(parts):
                    rows = loaded.shape[1] // len(parts)
                    self.weight_loader(param, loaded[e].narrow(0, i * rows, rows), (e, part))
            return
        expert, part = shard_id
        if expert == "shared":  # the shared MLP [S I, H] (gate, up) or [H, S I] (down)
            dim = 0 if part in self._ROWS else 1
            if not self.num_shared or loaded.shape[dim] % self.num_shared:
                raise ValueError(
                    f"{type(self).__name__}: checkpoint shared-expert tensor of shape "
                    f"{tuple(loaded.shape)} does not split into n_shared_experts="
                    f"{self.num_shared}: the checkpoint does not match its config.json"
                )
            for s, chunk in enumerate(loaded.chunk(self.num_shared, dim)):
                self._load_expert(param, chunk, self.num_experts + s, part)
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint expert {expert} is outside the config's n_routed_experts="
                f"{self.num_experts}: the checkpoint does not match its config.json"
            )
        self._load_expert(param, loaded, expert, part)

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, part: str):
        """This rank's slice of the expert: rows of gate and of up, columns of down (in the
        parameter's units: values, packed words or scale groups alike)."""
        shard_id = (expert, part)
        target = param.data[expert]
        if part in self._ROWS:  # [2 I/tp, ...]: this part's half
            dim, n = 0, target.shape[0] // 2
            target = target.narrow(0, self._ROWS[part] * n, n)
        else:  # [H, I/tp]
            dim, n = 1, target.shape[1]
        whole = list(target.shape)
        whole[dim] *= self.tp_size
        if list(loaded.shape) != whole:
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor {shard_id} of shape "
                f"{tuple(loaded.shape)} does not fit {tuple(whole)}: the checkpoint does "
                f"not match its config.json"
            )
        target.copy_(loaded.narrow(dim, self.tp_rank * n, n))

    def reads_layout(self, rows: int) -> bool:
        """Whether the fused forward of `rows` (token, expert) rows reads a row layout (the
        grouped GEMM's), so the router should make one."""
        return True

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) in `dtype`."""
        return self.gate_up_proj[e], self.down_proj[e]

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, top_k] float32
        ids: torch.Tensor,  # [T, top_k] int64
        add: torch.Tensor | None = None,  # [T, H] added to the sum (the shared experts')
        layout: torch.Tensor | None = None,  # moe_layout_no_sync(ids, E + shared) if known
    ) -> torch.Tensor:  # [T, H]
        if x.shape[0] <= FUSED_MAX_TOKENS:
            out = self.forward_fused(x, weights, ids, add, layout)
            if out is not None:
                return out
        out = self.forward_reference(x, weights, ids)
        return out if add is None else out + add

    def fused_serves(self, dtype: torch.dtype) -> bool:
        """Whether forwards of at most FUSED_MAX_TOKENS tokens in `dtype` take the fused path
        (no host read, so CUDA graphs may capture them) when serving: on CUDA, with the fused
        kernels on, for INT4 and unquantized experts alike."""
        return moe_fused.moe_gemm_serves(next(self.parameters()).device, dtype)

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, top_k] float32
        ids: torch.Tensor,  # [T, top_k] int64
        add: torch.Tensor | None = None,  # [T, H]
        layout: torch.Tensor | None = None,  # as forward's
    ) -> torch.Tensor | None:  # [T, H]; None where the fused kernels do not serve x
        """No host reads: graph-safe."""
        rows = ids.reshape(-1)  # [R]: row r is token r // top_k's choice r % top_k
        # The rows sorted by expert once, for both GEMMs (they route the same rows), where
        # they read one: INT4's GEMV at decode sizes reads none.
        if layout is None and fused.use_fused(x) and self.reads_layout(rows.numel()):
            layout = moe_fused.moe_layout_no_sync(rows, self.num_experts + self.num_shared)
        h = self._moe_gemm(x, rows, ids.shape[1], False, layout)  # [R, I]: silu(gate) * up
        if h is None:
            return None
        down = self._moe_gemm(h, rows, 1, True, layout)  # [R, H]
        return moe_fused.moe_combine(down, weights, add)

    def _moe_gemm(
        self,
        a: torch.Tensor,
        rows: torch.Tensor,
        rows_per_a: int,
        down: bool,
        layout: torch.Tensor | None,
    ) -> torch.Tensor | None:
        weight = self.down_proj if down else self.gate_up_proj
        return moe_fused.moe_gemm(a, rows, weight, rows_per_a, layout=layout, gated=not down)

    def forward_reference(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, top_k] float32
        ids: torch.Tensor,  # [T, top_k] int64
    ) -> torch.Tensor:  # [T, H]
        out = torch.zeros_like(x)
        hit = torch.unique(ids).tolist()  # CPU-GPU sync point: which experts run
        for e in hit:  # ascending, as the reference: each token's sum rounds the same way
            token, slot = torch.where(ids == e)
            gate_up, down = self.expert_weights(e, x.dtype)
            h = self.act(F.linear(x[token], gate_up))
            h = F.linear(h, down) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


class Int4FusedExperts(FusedExperts):
    """FusedExperts whose weights stay INT4 in memory: `gate_up_proj_packed` int32
    [E, 2I, ceil(H/8)] and `gate_up_proj_scale` [E, 2I, ceil(H/g)] (gate rows then up rows),
    `down_proj_packed` int32 [E, H, ceil(I/8)] and `down_proj_scale` [E, H, ceil(I/g)]. Scales
    take the model's dtype. Checkpoints' per-expert `weight_packed` / `weight_scale` load into
    their slice with the same shard ids as FusedExperts'.

    Split over ranks as FusedExperts, I being I/tp: gate and up by rows, down by packed words
    and scale groups, which is why I/tp must hold whole ones (`split_unit`)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        group_size: int,
        tp: TPGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self._init_split(num_experts, intermediate, tp)
        local, unit = self.intermediate, split_unit(group_size)
        if self.tp_size > 1 and local % unit:
            fits = [t for t in range(2, intermediate + 1) if intermediate % (t * unit) == 0]
            raise ValueError(
                f"INT4 experts' moe_intermediate_size {intermediate} over tensor-parallel size "
                f"{self.tp_size} leaves {local} down-projection inputs per rank, not a multiple "
                f"of {unit} (whole scale groups of {group_size} and packed words of {PACK}): "
                f"use tensor_parallel_size in {[1, *fits]}"
            )
        self.hidden, self.group_size = hidden, group_size
        e, i2 = num_experts, 2 * local

        def words(n: int) -> int:
            return -(-n // PACK)

        def groups(n: int) -> int:
            return -(-n // group_size)

        def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.gate_up_proj_packed = param(e, i2, words(hidden), dtype=torch.int32)
        self.gate_up_proj_scale = param(e, i2, groups(hidden))
        self.down_proj_packed = param(e, hidden, words(local), dtype=torch.int32)
        self.down_proj_scale = param(e, hidden, groups(local))
        self._register_loaders(
            ("gate_up_proj_packed", "gate_up_proj_scale"), ("down_proj_packed", "down_proj_scale")
        )
        self.act = SiluAndMul()

    def reads_layout(self, rows: int) -> bool:
        return not moe_fused.gemv_serves(rows, self.group_size)  # the GEMV reads none

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group_size
        gate_up = dequantize_int4(
            self.gate_up_proj_packed[e], self.gate_up_proj_scale[e], self.hidden, g, dtype
        )
        down = dequantize_int4(
            self.down_proj_packed[e], self.down_proj_scale[e], self.intermediate, g, dtype
        )
        return gate_up, down

    def _moe_gemm(
        self,
        a: torch.Tensor,
        rows: torch.Tensor,
        rows_per_a: int,
        down: bool,
        layout: torch.Tensor | None,
    ) -> torch.Tensor | None:
        name = "down_proj" if down else "gate_up_proj"
        packed, scale = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        return moe_fused.moe_gemm(
            a, rows, packed, rows_per_a, scale, self.group_size, layout, gated=not down
        )
