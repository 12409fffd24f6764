"""The soft cross-entropy kernels (outrider/train/soft_ce.py) on CUDA against the PyTorch path,
at the draft vocabulary's real width: values, argmax, and gradients in the logits' dtype (bf16
under autocast: the kernel rounds its fp32 gradient once, as the PyTorch path's cast does)."""

from __future__ import annotations

import pytest
import torch

from outrider.train.soft_ce import _FusedSoftCE, soft_ce

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_torch_path(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, v, shift, keep = 3, 70, 16384, 2, 60
    z = (torch.randn(b, t, v, device="cuda", generator=g) * 4).to(dtype)
    z[1, 3, 7] = z[1, 3, 9000] = 80.0  # a tie across blocks: the first index wins
    p = torch.softmax(torch.randn(b, t, v, device="cuda", generator=g) * 3, -1) * 0.95
    a, ref = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    got = soft_ce(a, p, shift, keep)  # CUDA: the kernels
    z32 = ref.float()[:, :keep]  # the PyTorch path, written out
    lse = torch.logsumexp(z32, -1)
    want = (p[:, shift : shift + keep].sum(-1) * lse - (p[:, shift : shift + keep] * z32).sum(-1),
            lse, z32.argmax(-1))  # fmt: skip
    w_ce = torch.randn(b, keep, device="cuda", generator=g)
    w_lse = torch.randn(b, keep, device="cuda", generator=g)
    ((got[0] * w_ce).sum() + (got[1] * w_lse).sum()).backward()
    ((want[0] * w_ce).sum() + (want[1] * w_lse).sum()).backward()
    assert torch.allclose(got[0], want[0], atol=1e-3, rtol=1e-5)
    assert torch.allclose(got[1], want[1], atol=1e-4, rtol=1e-6)
    assert torch.equal(got[2], want[2]) and got[2][1, 3].item() == 7
    assert a.grad.dtype == dtype and not a.grad[:, keep:].any()
    # The exact gradient (fp64) of the same loss; the kernel's is that, rounded once to the
    # logits' dtype, up to fp32 noise on the terms that cancel (P * softmax vs p).
    z64, p64 = z.double()[:, :keep], p.double()[:, shift : shift + keep]
    sm = torch.softmax(z64, -1)
    coef = (w_ce.double() * p64.sum(-1) + w_lse.double())[..., None]
    exact = coef * sm - w_ce.double()[..., None] * p64
    terms = (coef.abs() * sm + w_ce.double().abs()[..., None] * p64).max().item()
    err = (a.grad[:, :keep].double() - exact).abs()
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-23
    bound = exact.abs() * ulp + terms * 1e-6
    assert (err <= bound).all(), (err - bound).max().item()
    ref_err = (ref.grad[:, :keep].double() - exact).abs()
    assert err.mean().item() <= 1.5 * ref_err.mean().item() + 1e-12  # no worse than torch's


def test_cuda_uses_the_kernels():
    z = torch.randn(1, 4, 64, device="cuda")
    ce, _, _ = soft_ce(z.requires_grad_(True), torch.rand(1, 4, 64, device="cuda"), 1, 3)
    assert type(ce.grad_fn).__name__ == _FusedSoftCE.__name__ + "Backward"
