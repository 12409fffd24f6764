"""What one token's KV slot holds in one layer: a model declares it (`kv_layout`), the paged
pool (executor/kv_cache.py) allocates from it. Multi-head attention caches k and v
([kv_heads, head_dim] each); MLA caches one compressed latent ([kv_lora_rank + rope_dim])."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    components: tuple[tuple[str, tuple[int, ...]], ...]  # (name, per-token shape)
    dtype: torch.dtype

    @classmethod
    def multi_head(cls, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVLayout:
        return cls((("k", (kv_heads, head_dim)), ("v", (kv_heads, head_dim))), dtype)

    @classmethod
    def latent(cls, width: int, dtype: torch.dtype) -> KVLayout:
        return cls((("latent", (width,)),), dtype)

    @property
    def is_latent(self) -> bool:
        return [name for name, _ in self.components] == ["latent"]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) for _, shape in self.components) * elem
