"""Linear layers whose parameters know how to load (and, under tensor parallelism, slice) their
checkpoint weights: `param.weight_loader(param, loaded, shard_id)`.

Column-parallel layers split the output dimension across ranks, row-parallel ones the input
dimension and all-reduce their partial sums themselves. With one rank every loader is a copy
and nothing is reduced; the slicing is here so that parallelism stays a property of the layers.

Each layer takes its `TPGroup` as a constructor argument rather than from a process-wide
"current group": a process holds models of different parallelism side by side (a drafter on
one rank beside a target split over all of them; TP 1 and TP N models in one test), and a
layer must reduce over the group its model was built for.
"""

from __future__ import annotations

import torch
from torch import nn

from outrider.distributed import TPGroup, kv_heads_per_rank, single
from outrider.layers import batch_invariant, cpu_gemm


class _Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or single()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # The GEMM every forward calls: F.linear (on the CPU in the form that streams the
        # weights fastest: layers/cpu_gemm.py), or the deterministic mode's row-invariant one.
        self.gemm = cpu_gemm.linear

    def use_batch_invariant(self) -> None:
        """Compute each row with an order of sums independent of the batch (deterministic mode;
        layers/batch_invariant.py)."""
        self.gemm = batch_invariant.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, self)


class ColumnParallelLinear(_Linear):
    """y = x W^T with W's rows (outputs) split across ranks: each rank holds its slice of y."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup | None = None
    ):
        tp = tp or single()
        _divisible(out_features, tp.size, "output features")
        super().__init__(in_features, out_features // tp.size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * n, n), self)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input packed into one matmul (gate_up_proj).
    Checkpoint shards arrive one at a time with shard_id = their index in `output_sizes`; a
    rank's output is [its slice of projection 0 | its slice of projection 1 | ...]."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPGroup | None = None,
    ):
        tp = tp or single()
        for size in output_sizes:
            _divisible(size, tp.size, "output features")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * size, size), self)


class QKVParallelLinear(_Linear):
    """q, k and v projections packed into one matmul. Output layout per rank:
    [q heads of this rank | k heads | v heads], each head head_dim wide.

    Query heads split evenly. KV heads split too when there are at least as many as ranks;
    with fewer, each rank holds one KV head — the one its query heads read — replicated on
    tp_size / num_kv_heads ranks (9 heads, 3 KV heads at TP 9: ranks 0-2 hold KV head 0)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup | None = None,
    ):
        tp = tp or single()
        _divisible(num_heads, tp.size, "attention heads")
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(
                f"{num_kv_heads} KV heads neither split over tensor-parallel size {tp.size} nor "
                f"replicate evenly on it: pick a divisor or a multiple of {num_kv_heads}"
            )
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        # The KV shard this rank holds: its own, or the one it shares with its replicas.
        self.kv_shard = tp.rank // max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, shard = {
            "q": (0, q, self.tp_rank),
            "k": (q, kv, self.kv_shard),
            "v": (q + kv, kv, self.kv_shard),
        }[shard_id]
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, shard * size, size), self)


class RowParallelLinear(_Linear):
    """y = x W^T with W's columns (inputs) split across ranks: each rank multiplies its slice
    of x and the partial sums are all-reduced here, so every rank returns the whole y.

    reduce=False returns this rank's partial sum instead (the bias on rank 0 only), for a
    caller that adds several partial sums and reduces them once (the MoE block: routed and
    shared experts, one all-reduce rather than two).

    input_is_parallel=False takes the whole x on every rank and multiplies this rank's slice
    of its columns (the EAGLE-3 drafter's fc, whose input is the target's residual streams,
    whole on every rank); at one rank both read the same.

    forward(x, residual, norm) ends in the residual add and the norm as one call:
    (norm(y + residual), y + residual) from the reduce, then the one fused add + RMSNorm kernel
    (layers/norm.py), the bias added once before it. It launches what the two calls launch
    today and gives the same bits; it is the place where a kernel that reduces, adds and
    normalises in one pass (a one-shot all-reduce with the norm fused, as TensorRT-LLM's) would
    go, saving a launch and a round trip of y through memory per reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        reduce: bool = True,
        input_is_parallel: bool = True,
    ):
        tp = tp or single()
        _divisible(in_features, tp.size, "input features")
        super().__init__(in_features // tp.size, out_features, bias, tp)
        self.reduce = reduce
        self.input_is_parallel = input_is_parallel

    def forward(
        self,
        x: torch.Tensor,  # [T, in / tp] (input_is_parallel) or [T, in]
        residual: torch.Tensor | None = None,  # [T, out], with norm only
        norm: nn.Module | None = None,  # an RMSNorm over out
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """-> y [T, out], whole on every rank; with `norm`: (normed, new residual) [T, out]
        each, the new residual y + residual (y itself without one)."""
        if norm is None and residual is not None:
            raise ValueError("RowParallelLinear: a residual is added only before a norm: pass norm")
        if not self.input_is_parallel and self.tp_size > 1:
            n = self.weight.shape[1]
            x = x.narrow(-1, self.tp_rank * n, n)
        if self.tp_size == 1:
            y = self.gemm(x, self.weight, self.bias)
        elif not self.reduce:  # the sum over ranks holds the bias once
            if norm is not None:
                raise ValueError(
                    "RowParallelLinear(reduce=False) returns a partial sum, which cannot be "
                    "normalised: reduce first, or build it with reduce=True"
                )
            return self.gemm(x, self.weight, self.bias if self.tp_rank == 0 else None)
        else:
            y = self.tp.all_reduce(self.gemm(x, self.weight))
            if self.bias is not None:
                y = y + self.bias  # added once, after the sum
        if norm is None:
            return y
        return (norm(y), y) if residual is None else norm(y, residual)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            _copy_checked(param.data, loaded, self)
            return
        n = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * n, n), self)


def _divisible(n: int, tp_size: int, what: str) -> None:
    if n % tp_size:
        raise ValueError(
            f"{n} {what} do not split over tensor-parallel size {tp_size}: pick a tensor-"
            f"parallel size that divides {n}"
        )


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, layer: nn.Module) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"{type(layer).__name__}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
            f"parameter shard {tuple(target.shape)}: the checkpoint does not match its config.json"
        )
    target.copy_(loaded)
