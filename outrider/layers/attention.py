from __future__ import annotations

from collections.abc import Callable

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


class LatentAttention(nn.Module):
    """Paged multi-head latent attention (MLA, DeepSeek-V2/V3) for one layer. Its cache holds
    one latent per token ({"latent": [num_blocks, block_size, kv_lora_rank + rope_dim]}: the
    normalised compressed KV, then the roped shared key), not per-head K/V; the owner's
    `expand` turns latents into per-head keys and values."""

    def __init__(self, num_heads: int, v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.v_head_dim, self.scale = num_heads, v_head_dim, scale
        self.kv_cache: dict[str, torch.Tensor] = {}

    def forward(
        self,
        q: torch.Tensor,  # [T, heads, qk_head_dim]
        latent: torch.Tensor,  # [T, kv_lora_rank + rope_dim]
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [T, heads * v_head_dim]
        if not self.kv_cache:
            raise RuntimeError(
                "attention has no KV cache bound: allocate the pool before a forward"
            )
        ctx = get_forward_context()
        out = ctx.backend.forward_latent(q, latent, self.kv_cache, ctx.attn, self.scale, expand)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)
