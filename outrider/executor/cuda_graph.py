"""CUDA graphs for fixed-shape forwards: one runner keyed by (mode, padded batch, tokens per
sequence). DECODE is (DECODE, B, 1); a chain VERIFY of k drafts is (VERIFY, B, 1 + k) — one more
key, not another runner.

Graphs replay kernels with the addresses they were captured with, so every input lives in a
static buffer (`StaticInputs`), sized for the largest key, and a step copies its inputs in.
A batch of B real sequences replays the graph of the smallest captured size >= B; the padded
rows decode a dummy token into a scratch block the block manager never hands out, and their
outputs are dropped.

Capture goes largest first into one shared memory pool, so smaller graphs reuse its memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from outrider.core import ForwardMode
from outrider.executor.inputs import ForwardInputs
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class GraphKey:
    mode: ForwardMode
    batch: int  # padded number of sequences
    tokens_per_seq: int


@dataclass
class StaticInputs:
    """Every tensor a captured forward reads, at its largest size; keys use leading slices."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32

    @classmethod
    def allocate(cls, max_batch: int, max_tokens: int, max_blocks: int, device) -> StaticInputs:
        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            z(max_tokens, dtype=torch.int64),
            z(max_tokens, dtype=torch.int64),
            z(max_tokens, dtype=torch.int64),
            z(max_batch, dtype=torch.int32),
            z(max_batch + 1, dtype=torch.int32),
            z(max_batch, max_blocks, dtype=torch.int32),
        )


class GraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
        tokens_per_seq: tuple[int, ...] = (1,),
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        """aux_layers: the graphs also output those layers' input residual streams,
        concatenated (a drafter's features), as eager forwards do."""
        self.model, self.backend = model, backend
        self.aux_layers = tuple(aux_layers)
        self.max_blocks, self.scratch_block, self.block_size = max_blocks, scratch_block, block_size
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.tokens_per_seq = tuple(sorted(tokens_per_seq))
        device = next(model.parameters()).device
        max_batch, max_tpq = self.batch_sizes[-1], self.tokens_per_seq[-1]
        self.inputs = StaticInputs.allocate(max_batch, max_batch * max_tpq, max_blocks, device)
        # key -> (graph, hidden output, aux output or None)
        self.graphs: dict[
            GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]
        ] = {}
        self.pool = None

    # -- capture ----------------------------------------------------------------------------

    def capture(self) -> None:
        for tpq in reversed(self.tokens_per_seq):
            mode = ForwardMode.DECODE if tpq == 1 else ForwardMode.VERIFY
            for batch in reversed(self.batch_sizes):
                self._capture(GraphKey(mode, batch, tpq))
        log.info("captured %d CUDA graphs", len(self.graphs))

    def _capture(self, key: GraphKey) -> None:
        self._fill_padding(key, first_row=0)
        meta = self._metadata(key)
        n = key.batch * key.tokens_per_seq
        ids, pos = self.inputs.input_ids[:n], self.inputs.positions[:n]
        with torch.inference_mode():
            for _ in range(2):  # warm up: lazy inits and autotuning happen outside the capture
                meta.backend_data.clear()
                self._forward(ids, pos, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            meta.backend_data.clear()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, aux = self._forward(ids, pos, meta)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, hidden, aux)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.backend.prepare(meta)
        with forward_context(ForwardContext(meta, self.backend)):
            hidden, aux = self.model(ids, pos, self.aux_layers)
        return hidden, (torch.cat(aux, dim=-1) if aux else None)

    def _metadata(self, key: GraphKey) -> AttentionMetadata:
        b, t = key.batch, key.tokens_per_seq
        s = self.inputs
        return AttentionMetadata(
            mode=key.mode,
            slot_mapping=s.slot_mapping[: b * t],
            query_start_loc=s.query_start_loc[: b + 1],
            seq_lens=s.seq_lens[:b],
            block_tables=s.block_tables[:b],
            query_lens_cpu=[t] * b,
            # Host-side context lengths are unknown at capture: backends used under graphs must
            # read seq_lens from the device tensor only.
            seq_lens_cpu=[self.max_blocks * self.block_size] * b,
        )

    def _fill_padding(self, key: GraphKey, first_row: int) -> None:
        """Rows from first_row on: t dummy tokens at positions 0.. of the scratch block."""
        b, t = key.batch, key.tokens_per_seq
        s = self.inputs
        if first_row >= b:
            return
        rows = b - first_row
        s.input_ids[first_row * t : b * t].zero_()
        s.positions[first_row * t : b * t].copy_(
            torch.arange(t, device=s.positions.device).repeat(rows)
        )
        scratch = self.scratch_block * self.block_size
        s.slot_mapping[first_row * t : b * t].copy_(
            scratch + torch.arange(t, device=s.positions.device).repeat(rows)
        )
        s.seq_lens[first_row:b].fill_(t)
        s.block_tables[first_row:b].fill_(self.scratch_block)
        s.query_start_loc[first_row + 1 : b + 1].copy_(
            s.query_start_loc[first_row] + t * torch.arange(1, rows + 1, device=s.positions.device)
        )

    # -- replay -----------------------------------------------------------------------------

    def key_for(self, mode: ForwardMode, batch: int, tokens_per_seq: int) -> GraphKey | None:
        if tokens_per_seq not in self.tokens_per_seq:
            return None
        padded = next((b for b in self.batch_sizes if b >= batch), None)
        return None if padded is None else GraphKey(mode, padded, tokens_per_seq)

    def can_run(self, inputs: ForwardInputs) -> GraphKey | None:
        meta = inputs.attn
        if meta.custom_mask is not None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        lens = set(meta.query_lens_cpu)
        if len(lens) != 1:
            return None
        tpq = lens.pop()
        mode = ForwardMode.DECODE if tpq == 1 else ForwardMode.VERIFY
        if meta.mode not in (ForwardMode.DECODE, ForwardMode.VERIFY):
            return None
        return self.key_for(mode, meta.batch_size, tpq)

    def replay(
        self, key: GraphKey, inputs: ForwardInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the step's inputs into the static buffers, replay, return the hidden states
        [num_tokens, hidden] and the aux streams [num_tokens, len(aux_layers) * hidden]."""
        meta, s = inputs.attn, self.inputs
        b, n = meta.batch_size, inputs.input_ids.shape[0]
        s.input_ids[:n].copy_(inputs.input_ids)
        s.positions[:n].copy_(inputs.positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.seq_lens[:b].copy_(meta.seq_lens)
        s.query_start_loc[: b + 1].copy_(meta.query_start_loc)
        width = meta.block_tables.shape[1]
        s.block_tables[:b, :width].copy_(meta.block_tables)
        s.block_tables[:b, width:].fill_(self.scratch_block)
        self._fill_padding(key, first_row=b)
        graph, hidden, aux = self.graphs[key]
        graph.replay()
        return hidden[:n], (None if aux is None else aux[:n])
