"""RowParallelLinear(x, residual, norm): the reduce, then the fused residual add + RMSNorm, in
one call, bit for bit what the two calls give, at one rank and over gloo at two."""

from __future__ import annotations

import pytest
import torch

from outrider.distributed import TPGroup, single
from outrider.layers.linear import RowParallelLinear
from outrider.layers.norm import RMSNorm
from tests.unit.test_tp import gather_from_ranks

IN, OUT, T = 96, 32, 5


def _cases(tp: TPGroup) -> dict[str, torch.Tensor]:
    """Each case's fused and unfused outputs on this rank, and what one call counted."""
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)
    x, residual = torch.randn(T, IN, generator=g), torch.randn(T, OUT, generator=g)
    norm = RMSNorm(OUT, 1e-5)
    norm.weight.data.copy_(1.0 + 0.1 * torch.randn(OUT, generator=g))
    out = {}
    for with_bias in (False, True):
        layer = RowParallelLinear(IN, OUT, bias=with_bias, tp=tp)
        layer.weight.weight_loader(layer.weight, weight)
        if with_bias:
            layer.bias.weight_loader(layer.bias, bias)
        whole = RowParallelLinear(IN, OUT, bias=with_bias, tp=tp, input_is_parallel=False)
        whole.load_state_dict(layer.state_dict())
        n = layer.weight.shape[1]
        shard = x.narrow(1, tp.rank * n, n)
        name = "bias" if with_bias else "plain"
        with torch.inference_mode():
            tp.reset_counts()
            out[f"{name}/fused"] = torch.stack(layer(shard, residual.clone(), norm))
            out[f"{name}/calls"] = torch.tensor(
                tp.counts().get("other", {}).get("all_reduce", {}).get("calls", 0)
            )
            out[f"{name}/unfused"] = torch.stack(norm(layer(shard), residual.clone()))
            normed, y = layer(shard, norm=norm)  # no residual: y is the new residual
            out[f"{name}/first"] = torch.stack([normed, y])
            out[f"{name}/first_ref"] = torch.stack([norm(layer(shard)), layer(shard)])
            out[f"{name}/whole_input"] = whole(x)
            out[f"{name}/sliced_input"] = layer(shard)
    return out


def _check(got: dict[str, torch.Tensor], calls: int) -> None:
    for name in ("plain", "bias"):
        assert torch.equal(got[f"{name}/fused"], got[f"{name}/unfused"]), name
        assert torch.equal(got[f"{name}/first"], got[f"{name}/first_ref"]), name
        assert torch.equal(got[f"{name}/whole_input"], got[f"{name}/sliced_input"]), name
        assert got[f"{name}/calls"].item() == calls, name  # one reduce, fused or not


def test_fused_reduce_add_norm_equals_the_two_calls_at_tp1():
    _check(_cases(single()), calls=0)


@pytest.mark.slow
def test_fused_reduce_add_norm_equals_the_two_calls_over_gloo_at_tp2(tmp_path):
    ranks = gather_from_ranks(_cases, 2, tmp_path)
    want = _cases(single())
    for got in ranks:
        _check(got, calls=1)
        for name in ("plain", "bias"):  # the sum over ranks is TP 1's, up to rounding
            err = (got[f"{name}/fused"] - want[f"{name}/fused"]).abs().max().item()
            assert err < 1e-5, (name, err)
    # The reduce hands every rank the same sum: the ranks' outputs agree bit for bit.
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])


def test_a_residual_without_a_norm_is_refused():
    layer = RowParallelLinear(IN, OUT)
    x = torch.zeros(T, IN)
    with pytest.raises(ValueError, match="pass norm"):
        layer(x, torch.zeros(T, OUT))
