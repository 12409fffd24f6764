from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outrider.layers import fused


class SiluAndMul(nn.Module):
    """silu(gate) * up for a packed [.., 2 * intermediate] gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(-1) == 1 and fused.use_fused(x):
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
