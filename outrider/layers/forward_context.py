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
    without a tree mask, attends to keys at positions <= its own.

    `tree_mask` ([num_tokens, M] bool) covers only the last M keys of each sequence: a query of
    sequence b sees every key before seq_lens[b] - M, and key seq_lens[b] - M + j iff its row
    has column j set. Its shape follows the step's query lengths, never the context, so it
    fits a CUDA graph's static buffers. Example, M = 3 (the longest query): A verifies a root
    R and two sibling drafts n0, n1 (parents [-1, -1]) at seq_len 8, so columns 0..2 are its
    keys 5..7; B computes its last 2 tokens at seq_len 6 (columns: keys 3..5), causally: its
    query t sits at column M - 2 + t and sees the columns up to it.
                  earlier keys    column 0  1  2
        A  R      all visible            1  .  .
        A  n0     all visible            1  1  .
        A  n1     all visible            1  .  1
        B  t0     all visible            1  1  .
        B  t1     all visible            1  1  1
    A sequence shorter than M has no key for its first M - seq_len columns (column j would be
    position seq_len - M + j < 0): whatever they hold is ignored.
    """

    mode: ForwardMode
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot of each new token's KV
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32, context length after this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Optional [num_tokens, M] bool (M >= 1, the same for every row): query token t of sequence b
    # sees every key at positions < seq_len_b - M (the prefix, all visible) and key
    # seq_len_b - M + j (j in [0, M)) iff tree_mask[t, j]. Keys at negative positions (M >
    # seq_len_b) do not exist. None means causal.
    tree_mask: torch.Tensor | None = None
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


def current_mode() -> ForwardMode | None:
    """The running forward's mode, or None outside a forward (collectives are counted by it)."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.attn.mode
