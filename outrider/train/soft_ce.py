"""The TTT loss's soft cross-entropy over the draft vocabulary, and the draft's top-1, in one
read of the logits: a Triton kernel pair on the GPU, PyTorch elsewhere.

For one row with draft logits z and target mass p on the draft vocabulary (not renormalised,
P = sum p):
    ce  = -sum_v p_v log softmax(z)_v = P * lse(z) - p . z
    d ce / d z = P * softmax(z) - p,    d lse / d z = softmax(z)
The PyTorch path (log_softmax, a product and a sum over [rows, Vd] in fp32) reads and writes
the vocabulary-wide tensors several times a step; at 16k rows x 16k draft tokens that is a GiB
each, and the loss took more GPU time than the drafter's layer (benchmarks/
eagle3_train_profile.py). The kernels stream each row once forward (online logsumexp, p . z,
P, argmax) and once backward (the gradient written straight in the logits' dtype).

Rows: step j of the unroll scores logits rows t < keep of each packed row against target rows
t + s (s = j + 1); the kernels index both in place, so neither is sliced into a copy.
"""

from __future__ import annotations

import functools

import torch


def soft_ce(
    logits: torch.Tensor,  # [B, T, Vd], any float dtype
    target: torch.Tensor,  # [B, T, Vd] target p on the draft vocabulary
    shift: int,
    keep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (ce [B, keep] fp32, lse [B, keep] fp32, argmax [B, keep]) of logits rows t < keep
    against target rows t + shift. ce and lse carry gradients to `logits`."""
    t = logits.shape[1]
    if target.shape != logits.shape or keep < 0 or (keep and keep + shift > t):
        raise ValueError(
            f"soft_ce: logits {tuple(logits.shape)} / target {tuple(target.shape)} with "
            f"shift={shift}, keep={keep}: need equal shapes and keep + shift <= {t} (or keep 0)"
        )
    if logits.is_cuda and keep > 0 and _triton():
        return _FusedSoftCE.apply(logits.contiguous(), target.contiguous(), shift, keep)
    z = logits[:, :keep].float()
    p = target[:, shift : shift + keep].float()
    lse = torch.logsumexp(z, dim=-1)
    ce = p.sum(-1) * lse - (p * z).sum(-1)
    return ce, lse, z.detach().argmax(-1)


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _launch(logits: torch.Tensor) -> tuple[int, int]:
    import triton

    v = logits.shape[-1]
    return min(4096, triton.next_power_of_2(v)), 8


class _FusedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, shift, keep):
        from outrider.train.soft_ce_kernels import soft_ce_bwd, soft_ce_fwd

        b, t, v = logits.shape
        f32 = dict(device=logits.device, dtype=torch.float32)
        ce, lse, mass = (torch.empty(b, keep, **f32) for _ in range(3))
        arg = torch.empty(b, keep, device=logits.device, dtype=torch.int64)
        block, warps = _launch(logits)
        soft_ce_fwd[(b * keep,)](
            logits, target, ce, lse, mass, arg, t, keep, shift, v, BLOCK=block, num_warps=warps
        )
        ctx.save_for_backward(logits, target, lse, mass)
        ctx.shift, ctx.keep, ctx.kernel = shift, keep, soft_ce_bwd
        ctx.mark_non_differentiable(arg)
        return ce, lse, arg

    @staticmethod
    def backward(ctx, g_ce, g_lse, _g_arg):
        logits, target, lse, mass = ctx.saved_tensors
        b, t, v = logits.shape
        g_ce = torch.zeros_like(lse) if g_ce is None else g_ce.float().contiguous()
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse.float().contiguous()
        grad = torch.zeros_like(logits)  # rows t >= keep take no part in this step's loss
        block, warps = _launch(logits)
        ctx.kernel[(b * ctx.keep,)](
            logits, target, lse, mass, g_ce, g_lse, grad, t, ctx.keep, ctx.shift, v,
            BLOCK=block, num_warps=warps,
        )  # fmt: skip
        return grad, None, None, None
