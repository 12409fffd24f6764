"""One byte buffer for a step's many small tensors: rank 0 packs them, the other ranks take
views of what they received. One broadcast instead of one per tensor (on PCIe without P2P each
collective costs tens of microseconds whatever its size).

Every part is padded to 8 bytes, so each view of another dtype starts aligned to it whatever
the order of the parts (int32 lengths, uint8 tree masks, bf16 hidden rows)."""

from __future__ import annotations

import math

import torch

ALIGN = 8

Layout = list[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each part, in order


def pack(parts: list[tuple[torch.Tensor, torch.dtype]]) -> torch.Tensor:
    """Every tensor as its dtype (bool as bytes), flat, padded: one uint8 tensor [n]."""
    out = []
    for x, dtype in parts:
        x = x.view(torch.uint8) if x.dtype == torch.bool else x.to(dtype)
        b = x.contiguous().reshape(-1).view(torch.uint8)  # a column slice copies here
        out.append(b)
        if pad := -b.numel() % ALIGN:
            out.append(b.new_zeros(pad))
    return torch.cat(out)


def unpack(payload: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The parts `layout` describes, in order, as views of `payload` (pack's output)."""
    out, at = [], 0
    for shape, dtype in layout:
        n = dtype.itemsize * math.prod(shape)
        out.append(payload[at : at + n].view(dtype).view(shape))
        at += n + (-n % ALIGN)
    return out


def packed_size(layout: Layout) -> int:
    """Bytes of pack's output for parts of `layout`: what a receiving rank allocates."""
    sizes = (dtype.itemsize * math.prod(shape) for shape, dtype in layout)
    return sum(n + (-n % ALIGN) for n in sizes)
