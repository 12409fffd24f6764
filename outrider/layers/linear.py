"""Linear layers whose parameters know how to load (and, under tensor parallelism, slice) their
checkpoint weights: `param.weight_loader(param, loaded, shard_id)`.

Column-parallel layers split the output dimension across ranks, row-parallel ones the input
dimension (their partial sums are all-reduced by the caller's collective). With tp_size=1 every
loader is a copy; the slicing is here so that parallelism stays a property of the layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded, self)


class ColumnParallelLinear(_Linear):
    """y = x W^T with W's rows (outputs) split across ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank=0, tp_size=1
    ):
        _divisible(out_features, tp_size, "output features")
        super().__init__(in_features, out_features // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * n, n), self)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input packed into one matmul (gate_up_proj).
    Checkpoint shards arrive one at a time with shard_id = their index in `output_sizes`."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank=0, tp_size=1
    ):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * size, size), self)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one matmul. Output layout per rank:
    [q heads of this rank | k heads | v heads], each head head_dim wide."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank=0,
        tp_size=1,
    ):
        _divisible(num_heads, tp_size, "attention heads")
        _divisible(
            num_kv_heads, tp_size, "KV heads"
        )  # KV-head replication for tp > kv heads: later
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp_size, num_kv_heads // tp_size
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * size, size), self)


class RowParallelLinear(_Linear):
    """y = x W^T with W's columns (inputs) split across ranks; the caller all-reduces y."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank=0, tp_size=1
    ):
        _divisible(in_features, tp_size, "input features")
        super().__init__(in_features // tp_size, out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, on every rank's full output
            _copy_checked(param.data, loaded, self)
            return
        n = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * n, n), self)


def _divisible(n: int, tp_size: int, what: str) -> None:
    if n % tp_size:
        raise ValueError(
            f"{n} {what} do not split over tensor-parallel size {tp_size}: pick a divisor"
        )


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, layer: nn.Module) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"{type(layer).__name__}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
            f"parameter shard {tuple(target.shape)}: the checkpoint does not match its config.json"
        )
    target.copy_(loaded)
