"""The paged KV pool: for every layer, `num_blocks` blocks of `block_size` token slots.

What one slot holds is a parameter, not an assumption: the model's `KVLayout`
(layers/kv_layout.py), multi-head k and v or one MLA latent; a drafter gets a pool of its own
with its own layout.
"""

from __future__ import annotations

import gc

import torch

from outrider.config import CacheConfig
from outrider.layers import fused
from outrider.layers.kv_layout import KVLayout
from outrider.transfer import to_device_no_sync


class KVPool:
    """Every attention layer's paged KV, as the model's `KVLayout` says a slot holds it (this
    rank's K/V heads, or one MLA latent): one tensor per component, [layers, blocks,
    block_size, *shape], so a layer's view is free and a slot is block * block_size + offset
    in every layer at once (`move` copies slots in all layers)."""

    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.layout, self.num_layers, self.device = layout, num_layers, device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tensors = {
            name: torch.zeros(
                (num_layers, num_blocks, block_size, *shape), dtype=layout.dtype, device=device
            )
            for name, shape in layout.components
        }

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Views for layer i: name -> [num_blocks, block_size, *shape]."""
        return {name: t[i] for name, t in self.tensors.items()}

    def move(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy every layer's entries at src slots to dst slots (flat slot = block * size +
        offset): accepted tree nodes move from node order to path order after a verify."""
        src = to_device_no_sync(src_slots, torch.int64, self.device)
        dst = to_device_no_sync(dst_slots, torch.int64, self.device)
        self.move_no_sync(src, dst)

    def move_no_sync(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`move` for slots already on the device (int64 [n]): graph-safe. Every source is read
        before any destination is written; a slot moved onto itself stays as it is."""
        for t in self.tensors.values():
            rows = t.view(self.num_layers, self.num_blocks * self.block_size, -1)
            if not fused.move_slots_(rows, src, dst):
                rows.index_copy_(1, dst, rows.index_select(1, src))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def num_blocks_for_budget(
    layout: KVLayout, num_layers: int, cache: CacheConfig, device: torch.device
) -> int:
    """How many blocks fit: cache.num_blocks if set; on CPU the byte budget; on CUDA
    gpu_memory_utilization of the device's total memory minus what is already in use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = layout.bytes_per_token * num_layers * cache.block_size
    if device.type == "cuda":
        # Memory torch's allocator holds but no tensor uses (a freed earlier engine) is ours,
        # but only once it is back with the device: the pool is one allocation, which the
        # allocator's cached segments cannot serve however much of them is idle (counting
        # them asked for 114 GiB where 100 were free after a run of other engines). An engine
        # dropped in a reference cycle holds its tensors until the cycle collector runs:
        # collected first, or a second engine in one process sees them as used.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
        where = f"gpu_memory_utilization={cache.gpu_memory_utilization} of {total / 2**30:.1f} GiB"
    else:
        budget = cache.cpu_kv_bytes
        where = f"cpu_kv_bytes={cache.cpu_kv_bytes}"
    blocks = budget // block_bytes
    if blocks < 2:
        raise ValueError(
            f"the KV budget ({where}) holds {max(blocks, 0)} blocks of {block_bytes} bytes: "
            f"raise it or lower max_model_len / the model size"
        )
    return int(blocks)
