"""layers/cpu_gemm.py: the default mode's GEMM on the CPU gives F.linear's product (up to
rounding) through oneDNN over a packed fp32 or bf16 weight (or, without oneDNN, the (W x^T)^T
form for 1..MAX_ROWS fp32 rows), packs a weight again once it changed, and leaves other inputs
to F.linear."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from outrider import env
from outrider.layers import cpu_gemm

FORMS = [True, False] if cpu_gemm._ONEDNN else [False]


@pytest.fixture(params=FORMS, ids=lambda on: "onednn" if on else "fallback")
def onednn(request, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_ONEDNN", request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 64, cpu_gemm.MAX_ROWS, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_give_the_product_of_f_linear(rows, bias, onednn):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    y = cpu_gemm.linear(x, w, b)
    assert y.shape == (rows, 200) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert (getattr(w, "_onednn", None) is not None) == onednn  # packed once, kept on w


@pytest.mark.skipif(not cpu_gemm._ONEDNN, reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 4, 70])
def test_bf16_rows_give_the_product_of_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    y = cpu_gemm.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and w._onednn[1] is not None  # through the packed weight
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=5e-2)


@pytest.mark.skipif(not cpu_gemm._ONEDNN, reason="torch built without oneDNN")
def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    lin = torch.nn.Linear(64, 32, bias=False).requires_grad_(False)
    torch.testing.assert_close(cpu_gemm.linear(x, lin.weight), F.linear(x, lin.weight))
    packed = lin.weight._onednn[1]
    assert cpu_gemm._packed(lin.weight) is packed  # kept while the weight stays as it was
    lin.weight.copy_(torch.randn(32, 64, generator=g))  # a loader writing the weight
    torch.testing.assert_close(cpu_gemm.linear(x, lin.weight), F.linear(x, lin.weight))
    lin.weight.data = torch.randn(32, 64, generator=g)  # a weight swapped in
    torch.testing.assert_close(cpu_gemm.linear(x, lin.weight), F.linear(x, lin.weight))
    assert lin.weight._onednn[1] is not packed


def test_a_lone_row_is_the_same_as_inside_its_doubled_product(monkeypatch):
    """Without oneDNN the one-row case multiplies two copies and keeps one: not a GEMV."""
    monkeypatch.setattr(cpu_gemm, "_ONEDNN", False)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(cpu_gemm.linear(x, w), torch.mm(w, torch.cat([x, x]).t()).t()[:1])


@pytest.mark.parametrize(
    "x, w",
    [
        (torch.randn(2, 3, 16), torch.randn(8, 16)),  # not [M, K]
        (torch.randn(4, 16).half(), torch.randn(8, 16).half()),  # neither fp32 nor bf16
        (torch.randn(4, 16), torch.randn(16, 8).t()),  # a transposed weight
        (torch.randn(0, 16), torch.randn(8, 16)),  # no rows
        (torch.randn(4, 16), torch.randn(8, 16, requires_grad=True)),  # a weight in training
    ],
)
def test_other_inputs_go_to_f_linear_as_they_are(x, w, monkeypatch, onednn):
    want = F.linear(x, w)

    def taken(*args, **kwargs):
        raise AssertionError("another form was taken")

    monkeypatch.setattr(torch, "mm", taken)
    monkeypatch.setattr(cpu_gemm, "_packed", taken)
    assert torch.equal(cpu_gemm.linear(x, w), want)


def test_a_fallback_prefill_goes_to_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_ONEDNN", False)
    x, w = torch.randn(cpu_gemm.MAX_ROWS + 1, 16), torch.randn(8, 16)
    want = F.linear(x, w)
    monkeypatch.setattr(torch, "mm", lambda *a: pytest.fail("the (W x^T)^T form was taken"))
    assert torch.equal(cpu_gemm.linear(x, w), want)


@pytest.mark.skipif(not cpu_gemm._ONEDNN, reason="torch built without oneDNN")
def test_a_weight_the_memory_left_cannot_copy_runs_unpacked_and_says_so_once(monkeypatch, caplog):
    """A packed copy must leave PACK_RESERVE of the host's memory available; a weight it would
    not is multiplied unpacked (the same product), and the first such weight is logged."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    small, large = torch.randn(16, 64, generator=g), torch.randn(512, 64, generator=g)
    room = cpu_gemm.PACK_RESERVE + small.nbytes  # the small one fits, the large one does not
    monkeypatch.setattr(cpu_gemm, "available_memory", lambda: room)
    monkeypatch.setattr(cpu_gemm, "_short_of_memory", False)
    with caplog.at_level("WARNING", logger=cpu_gemm.__name__):
        for w in (small, large, large.clone()):
            torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w))
    assert small._onednn[1] is not None and large._onednn[1] is None
    assert len(caplog.records) == 1 and "OUTRIDER_CPU_PACKED_WEIGHTS=0" in caplog.text
    monkeypatch.setattr(cpu_gemm, "available_memory", lambda: None)  # unknown: packed
    big = torch.randn(512, 64, generator=g)
    cpu_gemm.linear(x, big)
    assert big._onednn[1] is not None


def test_packing_can_be_turned_off_from_the_environment(monkeypatch):
    code = "from outrider.layers import cpu_gemm as c; print(c._ONEDNN, c.FORM)"
    off = {**os.environ, "OUTRIDER_CPU_PACKED_WEIGHTS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=off, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False cpu linear as mm(W, x^T)")
    monkeypatch.setenv("OUTRIDER_CPU_PACKED_WEIGHTS", "maybe")
    with pytest.raises(ValueError, match="OUTRIDER_CPU_PACKED_WEIGHTS='maybe'"):
        env.cpu_packed_weights()
