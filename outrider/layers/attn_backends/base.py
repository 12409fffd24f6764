"""Attention backends: registered by name, imported lazily. A new backend adds a file and a line."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from outrider.layers.forward_context import AttentionMetadata
from outrider.registry import Registry


class AttentionBackend(ABC):
    """Paged attention over a flat batch.

    Invariants: `forward` first writes this step's k/v into the cache at `meta.slot_mapping`,
    then attends each query token to its own sequence's keys only (positions up to its own, or
    as `meta.tree_mask` allows over the sequence's last M keys). Output rows follow the query
    rows.
    """

    name: str
    # Whether forward reads per-sequence lengths only from device tensors (never from
    # meta.seq_lens_cpu), so a CUDA graph captured once serves any context: DECODE graphs
    # need it, chain VERIFY graphs need it for multi-token queries too.
    graph_modes: frozenset = frozenset()
    # Whether `forward_latent` and `forward_latent_absorbed` are implemented (MLA models'
    # latent KV cache).
    supports_latent: bool = False
    # Whether `forward_latent_absorbed(..., written=True)` may be told that this step's latents
    # are in the cache already (stored at meta.slot_mapping by the kernel that made them).
    takes_written_latents: bool = False
    # Whether the backend has a deterministic form (constructed with deterministic=True): every
    # query row attends with arithmetic that depends on its own position and keys alone, so a
    # row gives the same bits as a decode row, a verify row or a prefill row, alone or in any
    # batch, chunked or not; and whether that holds for tree-mask rows too (their visible keys
    # are the prefix and their ancestors, which a decode after acceptance reads contiguously).
    has_deterministic: bool = False
    deterministic_trees: bool = False
    deterministic: bool = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive per-step data once (into meta.backend_data) instead of once per layer.
        The default derives nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: dict[str, torch.Tensor],  # "k", "v": [num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def forward_latent(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, qk_head_dim]: [nope | rope] per head
        latent: torch.Tensor,  # [num_tokens, width]: this step's [compressed kv | roped k]
        kv_cache: dict[str, torch.Tensor],  # "latent": [num_blocks, block_size, width]
        meta: AttentionMetadata,
        scale: float,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
        """Multi-head latent attention (MLA): write this step's latents at meta.slot_mapping,
        then attend as `forward` does, each key and value being `expand(latent)` ([n, width]
        -> k [n, heads, qk_head_dim], v [n, heads, v_head_dim])."""
        raise NotImplementedError(
            f"the {self.name} attention backend has no latent (MLA) attention: use "
            f"attention_backend='torch_ref'"
        )

    def forward_latent_absorbed(
        self,
        q_lat: torch.Tensor,  # [num_tokens, num_heads, r]: q_nope @ W_UK per head
        q_pe: torch.Tensor,  # [num_tokens, num_heads, d_r]: the roped query
        latent: torch.Tensor,  # [num_tokens, r + d_r]: this step's [compressed kv | roped k]
        kv_cache: dict[str, torch.Tensor],  # "latent": [num_blocks, block_size, r + d_r]
        meta: AttentionMetadata,
        scale: float,
        written: bool = False,  # the latents are at meta.slot_mapping already
    ) -> torch.Tensor:  # [num_tokens, num_heads, r]
        """Weight-absorbed MLA: write this step's latents at meta.slot_mapping (unless
        `written`, where takes_written_latents allows it), then attend as
        `forward` does with one KV head shared by every query head, the query [q_lat | q_pe],
        each key the whole cached latent and each value its first r (kv_lora_rank) columns.
        The two query parts come apart (views of the projections are fine): no copy joins
        them."""
        raise NotImplementedError(
            f"the {self.name} attention backend has no latent (MLA) attention: use "
            f"attention_backend='torch_ref'"
        )


_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", {
    "torch_ref": "outrider.layers.attn_backends.torch_ref:TorchRefBackend",
    "triton": "outrider.layers.attn_backends.triton:TritonBackend",
})  # fmt: skip


def get_backend(
    name: str, device_type: str = "cpu", latent: bool = False, deterministic: bool = False
) -> AttentionBackend:
    """latent: the model caches MLA latents; the backend must attend over them (both
    registered backends do: "auto" picks triton on CUDA, torch_ref elsewhere, either way).
    deterministic: the backend's batch-invariant form (has_deterministic)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" and "triton" in _BACKENDS else "torch_ref"
    cls = _BACKENDS.get(name)
    if deterministic and not cls.has_deterministic:
        raise ValueError(
            f"deterministic=True: the {name} attention backend has no batch-invariant form; "
            f"use attention_backend='auto' (triton on CUDA, torch_ref on the CPU)"
        )
    backend = cls(deterministic=True) if deterministic else cls()
    if latent and not backend.supports_latent:
        raise ValueError(
            f"the {name} attention backend has no latent (MLA) attention, which this model's "
            f"KV cache needs: use attention_backend='torch_ref' or 'auto'"
        )
    return backend
