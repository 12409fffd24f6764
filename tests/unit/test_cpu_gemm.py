"""layers/cpu_gemm.py: the default mode's GEMM on the CPU gives F.linear's product (up to fp32
rounding) in the (W x^T)^T form for 1..MAX_ROWS rows, and F.linear's own result elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider.layers import cpu_gemm


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, cpu_gemm.MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_give_the_product_of_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    y = cpu_gemm.linear(x, w, b)
    assert y.shape == (rows, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_lone_row_is_the_same_as_inside_its_doubled_product():
    """The one-row case multiplies two copies and keeps one: not a GEMV."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(cpu_gemm.linear(x, w), torch.mm(w, torch.cat([x, x]).t()).t()[:1])


@pytest.mark.parametrize(
    "x, w",
    [
        (torch.randn(cpu_gemm.MAX_ROWS + 1, 16), torch.randn(8, 16)),  # a prefill's rows
        (torch.randn(2, 3, 16), torch.randn(8, 16)),  # not [M, K]
        (torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16()),  # not fp32
        (torch.randn(4, 16), torch.randn(16, 8).t()),  # a transposed weight
        (torch.randn(0, 16), torch.randn(8, 16)),  # no rows
    ],
)
def test_other_inputs_go_to_f_linear_as_they_are(x, w, monkeypatch):
    want = F.linear(x, w)

    def mm(*args):
        raise AssertionError("the (W x^T)^T form was taken")

    monkeypatch.setattr(torch, "mm", mm)
    assert torch.equal(cpu_gemm.linear(x, w), want)
