from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from outrider.core import ForwardMode
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
    normalised compressed KV, then the roped shared key), not per-head K/V.

    Two equal forms, chosen by the step's mode:
    - expanded (prefill chunks): the owner's `expand` turns each cached latent into per-head
      keys and values, then attention is ordinary multi-head attention. Compute-bound chunks
      amortise the expansion over many queries.
    - absorbed (`absorb_modes`: DECODE, VERIFY): kv_b_proj is folded into the queries and
      outputs (`absorbed` gives W_UK [heads, d_n, r], W_UV [heads, d_v, r]), so every head
      attends to the cached latents themselves, one KV head of width r + d_r shared by all
      heads. Few queries per sequence: the latents are read once instead of expanded per step.
    """

    # Modes attended in the latent space; an instance may narrow them (tests force expansion).
    absorb_modes: frozenset = frozenset({ForwardMode.DECODE, ForwardMode.VERIFY})

    def __init__(self, num_heads: int, v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.v_head_dim, self.scale = num_heads, v_head_dim, scale
        self.kv_cache: dict[str, torch.Tensor] = {}

    def latent_sink(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(latent cache, slot_mapping) where whoever makes this step's latents may store them
        (fused.mla_prep_), then call forward with written=True: absorbed steps on a backend
        that takes written latents. None elsewhere: forward writes them."""
        ctx = get_forward_context()
        if (
            not self.kv_cache
            or ctx.attn.mode not in self.absorb_modes
            or not ctx.backend.takes_written_latents
        ):
            return None
        return self.kv_cache["latent"], ctx.attn.slot_mapping

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, heads, d_n]
        q_pe: torch.Tensor,  # [T, heads, d_r], roped in the cached keys' order
        latent: torch.Tensor,  # [T, r + d_r]
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        absorbed: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        written: bool = False,  # stored at latent_sink() already
    ) -> torch.Tensor:  # [T, heads * v_head_dim]
        if not self.kv_cache:
            raise RuntimeError(
                "attention has no KV cache bound: allocate the pool before a forward"
            )
        ctx = get_forward_context()
        t = q_nope.shape[0]
        if ctx.attn.mode not in self.absorb_modes:
            q = torch.cat([q_nope, q_pe], dim=-1)  # [T, heads, d_n + d_r], the keys' order
            out = ctx.backend.forward_latent(q, latent, self.kv_cache, ctx.attn, self.scale, expand)
            return out.reshape(t, self.num_heads * self.v_head_dim)
        # q_nope . (W_UK c) == (q_nope W_UK) . c per head, and P (W_UV c) == W_UV (P c): the
        # scores and the softmax (same scale) are the expanded form's, only the order of the
        # products changes.
        w_uk, w_uv = absorbed()  # [heads, d_n, r], [heads, d_v, r]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, heads, r]
        out_lat = ctx.backend.forward_latent_absorbed(
            q_lat, q_pe, latent, self.kv_cache, ctx.attn, self.scale, written=written
        )  # [T, heads, r]
        out = torch.einsum("thr,hvr->thv", out_lat, w_uv)
        return out.reshape(t, self.num_heads * self.v_head_dim)
