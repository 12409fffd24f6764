"""The one explicit carrier of per-forward metadata. The runner sets it around a forward with a
non-nesting context manager; attention layers read it. No module globals are mutated elsewhere."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from outrider.core import ForwardMode

if TYPE_CHECKING:
    from outrider.layers.attn_backends.base import AttentionBackend


@dataclass
class AttentionMetadata:
    """Where each query token sits and where its sequence's KV lives.

    Worked example, block_size 4, two sequences: A computes 3 prompt tokens at positions 0..2
    (blocks [7]); B decodes 1 token at position 5 (blocks [2, 9]).
        query_start_loc = [0, 3, 4]     seq_lens = [3, 6]      block_tables = [[7, 0], [2, 9]]
        slot_mapping    = [28, 29, 30, 37]   (block * 4 + position % 4; B's token: 9 * 4 + 1)
    Query token t of sequence i sits at position seq_lens[i] - query_len[i] + (t - start_i) and,
    without a custom mask, attends to keys at positions <= its own.
    """

    mode: ForwardMode
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token's KV
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32, context length after this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Optional [num_tokens, max_seq_len] bool: True where query token t may see key j of its own
    # sequence (tree verification); None means causal.
    custom_mask: torch.Tensor | None = None
    # Whatever the backend derives once per step (not per layer) in `prepare`.
    backend_data: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    backend: AttentionBackend


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "outrider_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if _CURRENT.get() is not None:
        raise RuntimeError("forward contexts do not nest: a forward is already running")
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "attention ran outside a forward context: wrap the forward in forward_context()"
        )
    return ctx
