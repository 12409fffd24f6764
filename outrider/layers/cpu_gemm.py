"""The default mode's GEMM, y = x W^T: F.linear, but on the CPU for a few rows computed as
(W x^T)^T with at least two columns.

Why: decode and verify steps multiply a few rows by weights far larger than the caches, so a
step streams every weight from memory once, and its speed is the memory bandwidth the GEMM
reaches. torch's CPU build hands F.linear of M rows to MKL as an M x K by K x N product, which
for small M reads the weights at a fraction of the bandwidth: one row is a GEMV on one thread.
The same product as W (N x K) times x^T (K x M), with M at least 2, is a GEMM over N, split
across the threads. The default model's GEMMs of one step (30 layers' projections and the LM
head, fp32, 2-core x86 VM, MKL): 52 ms as F.linear at one row against 26 ms this way; 113 -> 31
ms at 2 rows, 117 -> 40 at 3, 75 -> 40 at 4, 83 -> 50 at 8, 186 -> 155 at 64 (a one-row GEMV of
either form took the 52 ms, so a lone row is doubled: the copy's product is dropped).

Only the rounding differs from F.linear's (another summation order in MKL), as it differs
between F.linear's own paths at different M. CUDA tensors, other dtypes, more than MAX_ROWS rows
(prefills: there F.linear is a blocked GEMM already) and inputs of other shapes go to F.linear
as they are. The deterministic mode keeps its own GEMM (layers/batch_invariant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 128  # measured faster up to here (the 64-row step: 186 -> 155 ms; 128: 304 -> 261)
# What a step's time depends on here, for the kept step profiles' key (engine/speculation.py):
# a profile timed with another form of the GEMM is timed again.
FORM = f"cpu linear as mm(W, x^T), 2 to {MAX_ROWS} columns"


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not 1 <= rows <= MAX_ROWS
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    cols = x if rows > 1 else torch.cat([x, x])  # one column would be a GEMV on one thread
    y = torch.mm(weight, cols.t()).t()[:rows].contiguous()  # [M, N]
    return y if bias is None else y.add_(bias)
