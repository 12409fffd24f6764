"""CUDA graphs for fixed-shape forwards: one runner keyed by (mode, padded batch, tokens per
sequence). DECODE is (DECODE, B, 1); a chain VERIFY of k drafts is (VERIFY, B, 1 + k) — one more
key, not another runner.

Graphs replay kernels with the addresses they were captured with, so every input lives in a
static buffer (`StaticInputs`), sized for the largest key, and a step copies its inputs in.
A batch of B real sequences replays the graph of the smallest captured size >= B; the padded
rows decode a dummy token into a scratch block the block manager never hands out, and their
outputs are dropped.

Steps with prompt chunks (PREFILL: chunks beside decode rows, ragged query lengths) replay a
graph keyed by (PREFILL, B, T): up to B sequences of T tokens in all, split among them any way.
Sequences past the real ones are empty, and one sequence after the B holds the T - n tokens the
real ones leave (dummy tokens in the scratch block), so query_start_loc always ends at T. The
prefill kernel reads every length from the device and sizes its grid by T, the longest query
any split can give (an empty sequence's programs find no token and exit). Eagerly, such a step
launches every kernel of every layer from Python: the default model's 30 layers took 11-12 ms of
host time a step on an H100, where its device work takes well under one (replayed: 1.5 ms for
one prompt, and the time to a server's first token at one stream went from 13 to 3.3 ms).
Steps with decode rows beside the chunks (requests arriving while others decode) take them
with mixed_prefill (the engine's default): through a server on an H100, such a step ran 2.8-3.5
ms where eagerly it ran 23-25, and plain decoding went from 4.2k to 10.6k tok/s at 16 streams
(median time to first token 45 -> 14 ms) and from 6.9k to 16.1k at 64 (52 -> 33 ms). A first
measurement had seen the time to first token rise instead: its single load-testing client
process was the bottleneck (bench/serve.py, client_processes_at).

Capture goes largest first into one shared memory pool, so smaller graphs reuse its memory.

Under tensor parallelism every rank builds the same runner and captures the same keys in the
same order (executor/tp_graphs.py sees to it), so the all-reduces inside the graphs pair up
across ranks, and replays the key rank 0 names in each step's header (tp_channel.py). A
capture records its collectives instead of counting them; each replay adds the record to the
group's counts (TPGroup.recording, add_counts).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from outrider.core import ForwardMode
from outrider.distributed import TPGroup, single
from outrider.executor.inputs import ForwardInputs
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context
from outrider.progress import progress

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# PREFILL graphs' batch sizes (of those up to the largest captured, which is always one): fewer
# than decode's, as an empty sequence costs only programs that exit at once.
PREFILL_BATCH_SIZES = (1, 4, 16, 64)
# PREFILL graphs' token counts (of those below the largest asked for, which is always one).
PREFILL_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class GraphKey:
    mode: ForwardMode
    batch: int  # padded number of sequences
    tokens_per_seq: int  # 0 for PREFILL: `tokens` split among the sequences any way
    tokens: int = 0  # PREFILL: the padded token count of the step

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.mode == ForwardMode.PREFILL else self.batch * self.tokens_per_seq

    @property
    def num_seqs(self) -> int:
        """Sequences the graph's metadata holds: PREFILL keys have one more, the padding's."""
        return self.batch + (self.mode == ForwardMode.PREFILL)


@dataclass
class StaticInputs:
    """Every tensor a captured forward reads, at its largest size; keys use leading slices."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    # Per-token inputs of a custom step, by name: [max_tokens, width] (a drafter's hidden).
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls, max_batch: int, max_tokens: int, max_blocks: int, device, extra_widths=None
    ) -> StaticInputs:
        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        extras = {
            name: z(max_tokens, width, dtype=dtype)
            for name, (width, dtype) in (extra_widths or {}).items()
        }
        return cls(
            z(max_tokens, dtype=torch.int64),
            z(max_tokens, dtype=torch.int64),
            z(max_tokens, dtype=torch.int64),
            z(max_batch, dtype=torch.int32),
            z(max_batch + 1, dtype=torch.int32),
            z(max_batch, max_blocks, dtype=torch.int32),
            extras,
        )


# (input_ids [T], positions [T], extras {name: [T, width]}) -> outputs, each [T, ...] or None
StepFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple]


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
        step: StepFn | None = None,
        extra_widths: dict[str, tuple[int, torch.dtype]] | None = None,
        mode: ForwardMode | None = None,
        tp: TPGroup | None = None,
        prefill_tokens: tuple[int, ...] = (),
        mixed_prefill: bool = True,
    ) -> None:
        """aux_layers: the graphs also output those layers' input residual streams,
        concatenated (a drafter's features), as eager forwards do.
        step: what a graph runs, (ids, positions, extras) -> outputs; None runs the model's
        forward -> (hidden, aux streams or None). extra_widths: name -> (width, dtype) of the
        per-token inputs `step` reads. mode: every key's mode (DRAFT for a drafter's steps);
        None keys 1 token per sequence as DECODE and more as VERIFY. tp: the model's
        tensor-parallel group (its collectives are recorded at capture, counted at replay).
        prefill_tokens: token counts T of the PREFILL graphs (steps with prompt chunks), each
        captured at the PREFILL_BATCH_SIZES up to T and the largest batch size; () captures none (the backend must size its
        grids by the metadata's host lengths alone, and the model read nothing from the host
        in a prefill: the caller's to know). mixed_prefill: steps with decode rows (one-token
        queries) beside their prompt chunks take them too; else those run eagerly."""
        self.model, self.backend = model, backend
        self.tp = tp or single()
        self.aux_layers = tuple(aux_layers)
        self.step = step  # None: _model_step (not stored: a bound method would be a cycle)
        self.mode = mode
        self.max_blocks, self.scratch_block, self.block_size = max_blocks, scratch_block, block_size
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.tokens_per_seq = tuple(sorted(tokens_per_seq))
        self.prefill_tokens = tuple(sorted(prefill_tokens))
        self.mixed_prefill = mixed_prefill
        top = self.batch_sizes[-1]
        self.prefill_batch_sizes = tuple(b for b in PREFILL_BATCH_SIZES if b < top) + (top,)
        device = next(model.parameters()).device
        max_batch, max_tpq = self.batch_sizes[-1], self.tokens_per_seq[-1]
        self.inputs = StaticInputs.allocate(
            max_batch + 1,  # PREFILL keys' padding sequence
            max(max_batch * max_tpq, *self.prefill_tokens, 0),
            max_blocks,
            device,
            extra_widths,
        )
        # key -> (graph, its outputs, the collectives one replay runs)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, tuple, dict]] = {}
        self.pool = None
        self.replays: Counter[ForwardMode] = Counter()  # by the keys' mode

    # -- capture ----------------------------------------------------------------------------

    def capture_keys(self) -> list[GraphKey]:
        """What `capture` captures, in its order (largest first)."""
        prefill = [
            GraphKey(ForwardMode.PREFILL, batch, 0, tokens)
            for tokens in reversed(self.prefill_tokens)
            for batch in reversed(self.prefill_batch_sizes)
            if batch <= tokens
        ]
        return prefill + [
            GraphKey(self._mode(tpq), batch, tpq)
            for tpq in reversed(self.tokens_per_seq)
            for batch in reversed(self.batch_sizes)
        ]

    def capture(self) -> None:
        what = "drafter " if self.mode == ForwardMode.DRAFT else ""
        for key in progress(self.capture_keys(), f"capturing {what}CUDA graphs"):
            if key.mode == ForwardMode.PREFILL and not self.prefill_tokens:
                continue  # dropped: one failed
            try:
                self._capture(key)
            except RuntimeError as e:
                if key.mode != ForwardMode.PREFILL:
                    raise
                # A prefill that reads the host somewhere (a synchronizing op, a length
                # taken from a tensor) cannot be captured: those steps stay eager, the rest
                # is captured as before.
                log.warning(
                    "steps with prompt chunks run eagerly: capturing their CUDA graph "
                    "(%d sequences, %d tokens) failed: %s",
                    key.batch, key.tokens, str(e).splitlines()[0] if str(e) else type(e).__name__,
                )  # fmt: skip
                self.prefill_tokens = ()
                self.graphs = {k: g for k, g in self.graphs.items() if k.mode != key.mode}
                torch.cuda.synchronize()
        log.info("captured %d CUDA graphs", len(self.graphs))

    def _capture(self, key: GraphKey) -> None:
        self._fill_padding(key, first_row=0)
        meta = self._metadata(key)
        n = key.num_tokens
        ids, pos = self.inputs.input_ids[:n], self.inputs.positions[:n]
        extras = {name: t[:n] for name, t in self.inputs.extras.items()}
        with torch.inference_mode():
            # Warm up: lazy inits and autotuning happen outside the capture. Under tensor
            # parallelism the warm-ups' collectives run, paired with the other ranks' own.
            with self.tp.recording():
                for _ in range(2):
                    meta.backend_data.clear()
                    self._forward(ids, pos, extras, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            meta.backend_data.clear()
            # torch.cuda.graph captures on a side stream of its own; NCCL collectives issued
            # there are captured (recorded, not run) like any kernel.
            with self.tp.recording() as counted, torch.cuda.graph(graph, pool=self.pool):
                outputs = self._forward(ids, pos, extras, meta)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, outputs, counted)

    def _forward(self, ids, pos, extras: dict, meta: AttentionMetadata) -> tuple:
        if meta.mode == ForwardMode.PREFILL:
            # Its grid holds the longest query whole: no splits of the key range (their
            # workspace and count would follow the lengths seen at capture). Only backends
            # with PREFILL graphs get here, and they take num_splits.
            self.backend.prepare(meta, 1)
        else:
            self.backend.prepare(meta)
        with forward_context(ForwardContext(meta, self.backend)):
            return (self.step or self._model_step)(ids, pos, extras)

    def _model_step(self, ids, pos, extras) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, aux = self.model(ids, pos, self.aux_layers)
        return hidden, (torch.cat(aux, dim=-1) if aux else None)

    def _mode(self, tokens_per_seq: int) -> ForwardMode:
        if self.mode is not None:
            return self.mode
        return ForwardMode.DECODE if tokens_per_seq == 1 else ForwardMode.VERIFY

    def _metadata(self, key: GraphKey) -> AttentionMetadata:
        b, t = key.num_seqs, key.tokens_per_seq
        s = self.inputs
        # Host query lengths size the backend's grids: a PREFILL graph's must hold any split
        # of its tokens, the whole of them in one sequence included.
        query_lens = [key.tokens] + [0] * key.batch if key.mode == ForwardMode.PREFILL else [t] * b
        return AttentionMetadata(
            mode=key.mode,
            slot_mapping=s.slot_mapping[: key.num_tokens],
            query_start_loc=s.query_start_loc[: b + 1],
            seq_lens=s.seq_lens[:b],
            block_tables=s.block_tables[:b],
            query_lens_cpu=query_lens,
            # Host-side context lengths are unknown at capture: backends used under graphs must
            # read seq_lens from the device tensor only.
            seq_lens_cpu=[self.max_blocks * self.block_size] * b,
        )

    def _fill_padding(self, key: GraphKey, first_row: int, first_token: int = 0) -> None:
        """Rows from first_row on: t dummy tokens at positions 0.. of the scratch block. A
        PREFILL key's rows from first_row on are empty, and its padding sequence (row
        key.batch) takes the tokens from first_token on, the rest of key.tokens."""
        if key.mode == ForwardMode.PREFILL:
            self._fill_prefill_padding(key, first_row, first_token)
            return
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
        within = torch.arange(t, device=s.positions.device) % self.block_size  # t may pass a block
        s.slot_mapping[first_row * t : b * t].copy_(scratch + within.repeat(rows))
        s.seq_lens[first_row:b].fill_(t)
        s.block_tables[first_row:b].fill_(self.scratch_block)
        s.query_start_loc[first_row + 1 : b + 1].copy_(
            s.query_start_loc[first_row] + t * torch.arange(1, rows + 1, device=s.positions.device)
        )

    def _fill_prefill_padding(self, key: GraphKey, first_row: int, first_token: int) -> None:
        b, s = key.batch, self.inputs
        rest = key.tokens - first_token
        s.seq_lens[first_row:b].zero_()  # empty sequences: no query, no key
        s.block_tables[first_row : b + 1].fill_(self.scratch_block)
        s.query_start_loc[first_row + 1 : b + 1].fill_(first_token)
        s.query_start_loc[b + 1].fill_(key.tokens)
        s.seq_lens[b].fill_(rest)
        if rest:
            pos = torch.arange(rest, device=s.positions.device)
            s.input_ids[first_token : key.tokens].zero_()
            s.positions[first_token : key.tokens].copy_(pos)
            scratch = self.scratch_block * self.block_size
            s.slot_mapping[first_token : key.tokens].copy_(scratch + pos % self.block_size)

    # -- replay -----------------------------------------------------------------------------

    def key_for(self, mode: ForwardMode, batch: int, tokens_per_seq: int) -> GraphKey | None:
        if tokens_per_seq not in self.tokens_per_seq:
            return None
        padded = next((b for b in self.batch_sizes if b >= batch), None)
        return None if padded is None else GraphKey(mode, padded, tokens_per_seq)

    def prefill_key(self, batch: int, tokens: int) -> GraphKey | None:
        """The PREFILL graph for `batch` sequences of `tokens` tokens in all, if captured."""
        padded = next((t for t in self.prefill_tokens if t >= tokens), None)
        b = next((b for b in self.prefill_batch_sizes if b >= batch), None)
        if padded is None or b is None or b > padded:
            return None
        return GraphKey(ForwardMode.PREFILL, b, 0, padded)

    def can_run(self, inputs: ForwardInputs) -> GraphKey | None:
        meta = inputs.attn
        if meta.tree_mask is not None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if meta.mode == ForwardMode.PREFILL and self.mode is None:
            if not self.mixed_prefill and 1 in meta.query_lens_cpu:
                return None  # decode rows beside the chunks
            return self.prefill_key(meta.batch_size, inputs.input_ids.shape[0])
        lens = set(meta.query_lens_cpu)
        if len(lens) != 1:
            return None
        tpq = lens.pop()
        if self.mode is None and meta.mode not in (ForwardMode.DECODE, ForwardMode.VERIFY):
            return None
        return self.key_for(self._mode(tpq), meta.batch_size, tpq)

    def replay(self, key: GraphKey, inputs: ForwardInputs, extras: dict | None = None) -> tuple:
        """Copy the step's inputs (and `extras`, by name) into the static buffers, replay, and
        return the step's outputs cut to the real tokens: for the model's forward, the hidden
        states [num_tokens, hidden] and the aux streams [num_tokens, n_aux * hidden] or None."""
        n = self.load(key, inputs, extras)
        graph, outputs, counted = self.graphs[key]
        graph.replay()
        self.replays[key.mode] += 1
        self.tp.add_counts(counted, inputs.attn.mode.value)
        return tuple(None if o is None else o[:n] for o in outputs)

    def load(self, key: GraphKey, inputs: ForwardInputs, extras: dict | None = None) -> int:
        """The step's inputs into the static buffers, the rest of `key` padded; its tokens."""
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
        for name, t in (extras or {}).items():
            s.extras[name][:n].copy_(t)
        self._fill_padding(key, first_row=b, first_token=n)
        return n
