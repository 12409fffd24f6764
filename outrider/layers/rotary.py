"""Rotary position embedding in HF's rotate-half layout (checkpoint q/k weights are in that
layout; the GGUF loader undoes llama.cpp's interleaving permutation to get there)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from outrider.layers import fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
        inv_freq = _scale_inv_freq(inv_freq, scaling, head_dim, base)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        # YaRN scales q and k by sqrt of its attention factor each, through cos and sin (as HF).
        mscale = _yarn_attention_factor(scaling)
        # Kept in float32 whatever the model dtype: bf16 angles lose whole radians at long range.
        self.register_buffer("cos", freqs.cos() * mscale, persistent=False)
        self.register_buffer("sin", freqs.sin() * mscale, persistent=False)

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


def _scale_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any] | None, head_dim: int, base: float
) -> torch.Tensor:
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
    if kind == "yarn":
        return _yarn_inv_freq(scaling, head_dim, base)
    raise ValueError(
        f"unsupported rope scaling type {kind!r}: outrider supports {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's cos/sin multiplier: given, or mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) (DeepSeek: 1.0, as both are 1), or mscale(factor); 1 for other types."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_inv_freq(scaling: dict[str, Any], dim: int, base: float) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those turning more than beta_fast times are kept, with
    a linear ramp between (over dimension indices, the bounds floored/ceiled as HF does)."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"yarn rope scaling lacks {missing}: the checkpoint's config is broken")
    factor = scaling["factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
