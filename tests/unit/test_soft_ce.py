"""The TTT loss's soft cross-entropy (outrider/train/soft_ce.py): the PyTorch path against the
log-softmax formula it replaces, and the Triton kernels against the PyTorch path on the CPU
under Triton's interpreter (set before triton is imported, so in a subprocess that prints a
JSON line per check): values, argmax ties within and across blocks, and gradients, with rows
past `keep` left at zero. tests/gpu/test_soft_ce_cuda.py checks the kernels on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from outrider.train.soft_ce import soft_ce
from tests.interpreter import emit, run_worker


def _inputs(dtype, b=2, t=9, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(b, t, v, generator=g) * 3).to(dtype)
    p = torch.rand(b, t, v, generator=g)
    p = p / p.sum(-1, keepdim=True) * 0.9  # mass 0.9 on the draft vocabulary, as targets have
    return z, p


def test_torch_path_is_the_log_softmax_cross_entropy():
    z, p = _inputs(torch.float32)
    for shift, keep in ((1, 8), (3, 5), (4, 2)):
        a = z.clone().requires_grad_(True)
        ce, lse, arg = soft_ce(a, p, shift, keep)
        logp = F.log_softmax(z[:, :keep], dim=-1)
        want = -(p[:, shift : shift + keep] * logp).sum(-1)
        assert torch.allclose(ce, want, atol=1e-5, rtol=1e-5)
        assert torch.allclose(lse, torch.logsumexp(z[:, :keep], -1), atol=1e-6)
        assert torch.equal(arg, z[:, :keep].argmax(-1))
        ce.sum().backward()
        grad = p[:, shift : shift + keep].sum(-1, keepdim=True) * logp.exp()
        grad = grad - p[:, shift : shift + keep]
        assert torch.allclose(a.grad[:, :keep], grad, atol=1e-6)
        assert not a.grad[:, keep:].any()


def test_bad_shapes_are_refused():
    z, p = _inputs(torch.float32)
    with pytest.raises(ValueError, match="keep \\+ shift"):
        soft_ce(z, p, 3, 7)
    with pytest.raises(ValueError, match="equal shapes"):
        soft_ce(z, p[:, :5], 1, 2)
    ce, lse, arg = soft_ce(z, p, 12, 0)  # more draft steps than tokens: nothing scored
    assert ce.shape == lse.shape == arg.shape == (2, 0)


def _worker() -> None:  # runs in the subprocess, TRITON_INTERPRET=1
    from outrider.train.soft_ce import _FusedSoftCE

    for dtype in (torch.float32, torch.bfloat16):
        for v, (shift, keep) in ((300, (2, 6)), (5000, (1, 8))):  # 5000: two 4096 blocks
            z, p = _inputs(dtype, v=v)
            z[0, 1] = 0.0  # every logit tied: argmax 0
            z[1, 2, 5] = z[1, 2, v - 10] = 50.0  # a tie across blocks: the first wins
            a, b = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
            got, want = _FusedSoftCE.apply(a, p, shift, keep), soft_ce(b, p, shift, keep)
            w_ce, w_lse = torch.randn(2, keep), torch.randn(2, keep)
            ((got[0] * w_ce).sum() + (got[1] * w_lse).sum()).backward()
            ((want[0] * w_ce).sum() + (want[1] * w_lse).sum()).backward()
            line = {
                "name": f"{str(dtype).removeprefix('torch.')}-{v}",
                "ce": (got[0] - want[0]).abs().max().item(),
                "lse": (got[1] - want[1]).abs().max().item(),
                "arg_equal": torch.equal(got[2], want[2]),
                "ties": [got[2][0, 1].item(), got[2][1, 2].item()],
                "grad": (a.grad.float() - b.grad.float()).abs().max().item(),
                "grad_scale": b.grad.float().abs().max().item(),
                "grad_past_keep": a.grad[:, keep:].abs().max().item(),
            }
            emit(**line)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_under_the_interpreter_match_the_torch_path():
    lines = run_worker("tests.unit.test_soft_ce")
    assert len(lines) == 4, lines
    for r in lines:
        fp32 = r["name"].startswith("float32")
        assert r["ce"] < (1e-4 if fp32 else 2e-3), r
        assert r["lse"] < (1e-4 if fp32 else 2e-3), r
        assert r["arg_equal"] and r["ties"] == [0, 5], r
        # bf16: the interpreter truncates float32 -> bfloat16 where the GPU rounds (one step)
        assert r["grad"] <= (1e-5 if fp32 else 2**-7 * max(r["grad_scale"], 1.0)), r
        assert r["grad_past_keep"] == 0.0, r
