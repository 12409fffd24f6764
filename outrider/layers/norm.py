from __future__ import annotations

import torch
from torch import nn

from outrider.layers import batch_invariant, fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), optionally fused with the residual add:
    norm(x, residual) returns (normed(x + residual), x + residual)."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.row_invariant = False  # deterministic mode: use_batch_invariant()

    def use_batch_invariant(self) -> None:
        """Normalise each row with one summation order whatever the batch (deterministic mode:
        the fused kernel on CUDA, one row at a time elsewhere; layers/batch_invariant.py)."""
        self.row_invariant = True

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.row_invariant:
            return batch_invariant.rms_norm(self, x, residual)
        if self._fusable(x, residual):
            return fused.rms_norm(x, self.weight, self.eps, residual)
        return self.torch_forward(x, residual)

    def torch_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch form (float32 inside, as HF), any device and shape."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            x.dim() == 2
            and x.stride(-1) == 1
            and self.weight.dtype == x.dtype
            and (residual is None or (residual.stride(-1) == 1 and residual.dtype == x.dtype))
            and fused.use_fused(x)
        )
