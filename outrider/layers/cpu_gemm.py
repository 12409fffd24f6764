"""The default mode's GEMM, y = x W^T: F.linear, but on the CPU through oneDNN with the weight
packed once into its blocked layout.

Why: decode and verify steps multiply a few rows by weights far larger than the caches, so a
step streams every weight from memory once and its speed is the bandwidth the GEMM reaches;
a verify's rows (1 + k per sequence) should cost little more than a decode's. torch's CPU
build hands F.linear to MKL, which reads the weights at a fraction of the bandwidth for few
rows and whose time jumps with the row count. oneDNN's inner-product over a weight reordered
once (mkldnn._reorder_linear_weight, as torch's compiler does for frozen CPU models) keeps it
flat. The default model's GEMMs of one step (30 layers' projections and the LM head, fp32,
2-core AMD EPYC VM, medians): 1 row 30 ms, 4 rows 27, 8 28, 12 32, 16 40, 32 58, against 28,
33, 47-73, 82, 66-72, 110 for the form used before (W x^T)^T; prefill chunks 1.5x faster too
(2,048 rows of the 3072 x 576 projection: 49 ms against F.linear's 73). bf16 weights the same
way: 13 ms at one row and 18 at 16 against F.linear's 20 and 28 (the same step's GEMMs, an
EPYC with avx512_bf16).

The packed copy is kept beside the weight, keyed by its version: a weight loaded or changed in
place afterwards is packed again. It costs a second copy of every weight the GEMM meets (the
dense one stays: embeddings read it, loaders write it, training takes grads through F.linear),
so a weight is packed only while the host keeps PACK_RESERVE of its memory available beyond
that copy (MemAvailable, Linux): a model that fits once but not twice runs unpacked, not into
swap, and says so once in the log. OUTRIDER_CPU_PACKED_WEIGHTS=0 packs nothing.
Only the rounding differs from F.linear's. Where oneDNN is missing (a torch built without it)
or refuses a weight, the (W x^T)^T form with at least two columns is the fallback (2x
F.linear at one row: a one-column product is a GEMV on one thread; fp32 only). CUDA tensors,
dtypes other than fp32 and bf16, mixed dtypes, inputs of other shapes and weights that need a
gradient go to F.linear as they are. The deterministic mode keeps its own GEMM
(layers/batch_invariant.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from outrider import env

log = logging.getLogger(__name__)

MAX_ROWS = 128  # the fallback form's reach (measured faster up to here than F.linear)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
_ONEDNN = bool(
    env.cpu_packed_weights()
    and torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Host memory a packing must leave available: the rest of a step's working set (activations,
# KV blocks, the server) lives there too.
PACK_RESERVE = 1 << 30
_short_of_memory = False  # logged once
# What a step's time depends on here, for the kept step profiles' key (engine/speculation.py):
# a profile timed with another form of the GEMM is timed again.
FORM = (
    "cpu linear by oneDNN, packed fp32 and bf16 weights"
    if _ONEDNN
    else f"cpu linear as mm(W, x^T), 2 to {MAX_ROWS} columns"
)


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        x.device.type != "cpu"
        or x.dtype not in PACKED_DTYPES
        or weight.dtype != x.dtype
        or (bias is not None and bias.dtype != x.dtype)
        or rows < 1
        or not weight.is_contiguous()
        or (weight.requires_grad and torch.is_grad_enabled())
    ):
        return F.linear(x, weight, bias)
    packed = _packed(weight) if _ONEDNN else None
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if rows > MAX_ROWS or x.dtype != torch.float32:  # a prefill's rows (F.linear is a blocked
        # GEMM already), or bf16 (the fallback form is measured for fp32 only)
        return F.linear(x, weight, bias)
    cols = x if rows > 1 else torch.cat([x, x])  # one column would be a GEMV on one thread
    y = torch.mm(weight, cols.t()).t()[:rows].contiguous()  # [M, N]
    return y if bias is None else y.add_(bias)


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """weight in oneDNN's layout, packed at its first use and again after it changed; None
    where oneDNN refuses it (then never asked again for it)."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: no version counter, and it never changes
        version = -1
    key = (version, weight.data_ptr())
    kept = getattr(weight, "_onednn", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    if not _room_for(weight.nbytes):
        weight._onednn = (key, None)
        return None
    try:
        # No batch-size hint: packed for any row count (a hint of 1 made 16 rows 2x slower).
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:
        packed = None
    weight._onednn = (key, packed)
    return packed


def _room_for(nbytes: int) -> bool:
    """Whether a packed copy of `nbytes` leaves PACK_RESERVE of the host's memory available;
    logs the first refusal."""
    global _short_of_memory
    available = available_memory()
    if available is None or available - nbytes >= PACK_RESERVE:
        return True
    if not _short_of_memory:
        _short_of_memory = True
        log.warning(
            "CPU GEMMs: %d MB of memory available, too little to pack a %d MB weight for "
            "oneDNN beside the dense one and keep %d MB free; such weights run unpacked (slower "
            "for a verify's rows). More memory, or OUTRIDER_CPU_PACKED_WEIGHTS=0 to pack none.",
            available >> 20, nbytes >> 20, PACK_RESERVE >> 20,
        )  # fmt: skip
    return False


def available_memory() -> int | None:
    """The host's MemAvailable in bytes (/proc/meminfo); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
