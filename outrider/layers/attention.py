from __future__ import annotations

import torch
from torch import nn

from outrider.layers.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention for one layer. Its cache views are bound by the runner after the pool is
    allocated (`kv_cache`); the backend and per-step metadata come from the forward context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache: dict[str, torch.Tensor] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]
        if not self.kv_cache:
            raise RuntimeError(
                "attention has no KV cache bound: allocate the pool before a forward"
            )
        ctx = get_forward_context()
        out = ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
