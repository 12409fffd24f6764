"""Rotary position embedding in HF's rotate-half layout (checkpoint q/k weights are in that
layout; the GGUF loader undoes llama.cpp's interleaving permutation to get there)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from outrider.layers import fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class Rope(NamedTuple):
    """What every layer of one forward needs for rotary. Unfused: cos/sin gathered for the
    step's positions, [T, 1, head_dim / 2]. Fused (CUDA): the whole tables, [max_positions,
    head_dim / 2], and the kernel looks positions up itself."""

    positions: torch.Tensor  # [T]
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        # Kept in float32 whatever the model dtype: bf16 angles lose whole radians at long range.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """Done once per forward and shared by every layer."""
        if fused.use_fused(positions):
            return Rope(positions, self.cos, self.sin, fused=True)
        return Rope(
            positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), False
        )

    @staticmethod
    def apply(rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]
        cos, sin = rope.cos, rope.sin
        if rope.fused:  # tables, not rows: a caller that cannot rotate in place (q/k norms)
            cos, sin = cos[rope.positions].unsqueeze(1), sin[rope.positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    @staticmethod
    def apply_packed_(
        rope: Rope, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> bool:
        """Rotate the q and k heads of a packed [T, (heads + 2 * kv_heads) * head_dim] row in
        place with one kernel; False (nothing done) where the fused kernel does not serve."""
        if not rope.fused or qkv.stride(-1) != 1:
            return False
        fused.rotary_(qkv, rope.positions, rope.cos, rope.sin, num_heads, num_kv_heads, head_dim)
        return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # rotate-half: pairs (i, i + head_dim / 2)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope scaling type {kind!r}: outrider supports {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
