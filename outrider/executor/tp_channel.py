"""Rank 0 drives, the other ranks follow: every target forward's inputs go from rank 0 to the
other ranks as a fixed header and a few tensors (torch.distributed broadcasts, never pickle),
and each rank runs the same forward on them over its own shard of the weights and its own
slice of the KV pool (its KV heads).

Sampling and acceptance run on rank 0 alone. After the LM head's all-gather the logits are
whole and identical on every rank, so another rank deciding tokens would repeat rank 0's work
and would have to advance every seeded generator in lockstep with it; the other ranks need no
tokens, only the next step's inputs, which carry them. The drafter runs on rank 0 alone too
(a group of one: its forwards reduce nothing), unless it is split over the ranks like the
target (draft_tensor_parallel_size): then its forwards follow as ops of their own, drawn in
tp_draft.py. What a step changes in a rank's KV slice beyond
the forward's own writes (accepted tree nodes moved into path order) is sent the same way.

The header is int64 [HEADER] over the control group (gloo, a CPU tensor, no time limit: the
other ranks wait there while the engine is idle); the tensors follow over the tensor-parallel
group itself (NCCL on CUDA: device tensors), counted under the forward's mode.

    op FORWARD  mode, tokens T, batch B, table width W, tree-mask width M (0: causal),
                logits rows L (-1: every row, 0: none, n: the rows in logits_indices),
                graph G, its mode X, padded batch P, tokens per sequence Q: the CUDA graph
                rank 0 replays for this forward, keyed (X, P, Q) — G 0: none, eagerly;
                TARGET_GRAPH: the runner's GraphRunner (the LM head after it, eagerly, over L);
                SPEC_GRAPH: the speculative step's verify graph (B = P rows, logits inside)
                -> one uint8 payload (a single broadcast: on PCIe each collective costs tens
                   of microseconds whatever its size), holding in this order
                   input_ids [T], positions [T], slot_mapping [T], logits_indices [L > 0]
                   as int64, query_start_loc [B + 1], seq_lens [B], block_tables [B, W] as
                   int32, tree_mask [T, M > 0] as uint8 (tp_payload.pack: each part padded
                   to 8 bytes, so every view starts aligned)
    op MOVE_KV  n -> src [n] int64, dst [n] int64 flat slots (KVPool.move_no_sync)
    op GATHER_EMBEDDING   every rank all-gathers its shard of the vocabulary embedding (a
                drafter on rank 0 embeds with the whole table)
    op CAPTURE  speculative step S (0: none), draft lengths as a bit mask K (bit k: k drafts;
                0 for trees), tree T (0/1), the tree's node count N -> every rank captures
                the same CUDA graphs in the same order (executor/tp_graphs.py), so the
                collectives inside them pair up; the others' speculative step has no drafter
    op DRAFT, DRAFT_AFTER_VERIFY   a sharded drafter's forwards (tp_draft.py)
    op STOP     the worker loop returns

With one rank nothing here runs: the runner holds no sender and never checks more than that.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from outrider.core import ForwardMode
from outrider.distributed import TPGroup
from outrider.executor.cuda_graph import GraphKey
from outrider.executor.inputs import ForwardInputs
from outrider.executor.tp_draft import OP_DRAFT, OP_DRAFT_AFTER_VERIFY, DraftFollower
from outrider.executor.tp_payload import pack, packed_size, unpack
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context

if TYPE_CHECKING:  # both import this module: at run time these imports would be cycles
    from outrider.executor.model_runner import ModelRunner
    from outrider.executor.spec_step import SpecStep

log = logging.getLogger(__name__)

HEADER = 11
STOP, FORWARD, MOVE_KV, GATHER_EMBEDDING, CAPTURE = range(5)
DRAFT, DRAFT_AFTER_VERIFY = OP_DRAFT, OP_DRAFT_AFTER_VERIFY  # tp_draft.py's, after these
_MODES = list(ForwardMode)
ALL_ROWS = -1
EAGER, TARGET_GRAPH, SPEC_GRAPH = range(3)  # a forward header's G
MAX_MASKED_K = 62  # draft lengths a CAPTURE header's bit mask holds (bits 1..62 of an int64)


def ks_mask(ks: tuple[int, ...]) -> int:
    """Draft lengths as the bit mask a CAPTURE header carries: (1, 3) -> 0b1010."""
    bad = [k for k in ks if not 1 <= k <= MAX_MASKED_K]
    if bad:
        raise ValueError(
            f"draft lengths {bad} under tensor parallelism with CUDA graphs: the ranks agree "
            f"on lengths 1..{MAX_MASKED_K}; use num_draft_tokens <= {MAX_MASKED_K}"
        )
    return sum(1 << k for k in set(ks))


def ks_from_mask(mask: int) -> tuple[int, ...]:
    return tuple(k for k in range(1, MAX_MASKED_K + 1) if mask >> k & 1)


class StepSender:
    """Rank 0's side. `forwards` counts the forwards sent, by mode value (the collectives a
    forward runs are TPGroup.counts() divided by these)."""

    def __init__(self, tp: TPGroup) -> None:
        assert tp.rank == 0 and tp.size > 1
        self.tp = tp
        self.forwards: dict[str, int] = {}
        self._header = torch.zeros(HEADER, dtype=torch.int64)
        self.stopped = False

    def _send_header(self, *fields: int) -> None:
        self._header.zero_()
        self._header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self.tp.broadcast(self._header, control=True, mode="other")

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        logits_rows: torch.Tensor | int | None,  # [L] int64 rows, ALL_ROWS, or None (none)
        graph: tuple[int, ForwardMode, int, int] | None = None,  # (G, key: mode, B, per seq)
    ) -> None:
        """Before rank 0 runs a target forward: the others run the same one, and the LM head
        over the same rows (the head's all-gather is a collective too). graph: the captured
        graph rank 0 replays for it (None: it runs eagerly); the others replay the same."""
        mode = attn.mode.value
        self.forwards[mode] = self.forwards.get(mode, 0) + 1
        tables = attn.block_tables
        tree = attn.tree_mask
        if isinstance(logits_rows, torch.Tensor):
            n_logits = logits_rows.numel()
        else:
            n_logits = ALL_ROWS if logits_rows == ALL_ROWS else 0
        key = (EAGER, 0, 0, 0) if graph is None else (graph[0], _MODES.index(graph[1]), *graph[2:])
        self._send_header(
            FORWARD,
            _MODES.index(attn.mode),
            input_ids.numel(),
            tables.shape[0],
            tables.shape[1],
            0 if tree is None else tree.shape[1],
            n_logits,
            *key,
        )
        parts = [(input_ids, torch.int64), (positions, torch.int64),
                 (attn.slot_mapping, torch.int64)]  # fmt: skip
        if n_logits > 0:
            parts.append((logits_rows, torch.int64))
        parts += [(attn.query_start_loc, torch.int32), (attn.seq_lens, torch.int32),
                  (tables, torch.int32)]  # fmt: skip
        if tree is not None:
            parts.append((tree, torch.uint8))
        self.tp.broadcast(pack(parts), mode=mode)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rank 0 moved KV entries src -> dst (flat slots [n] int64): every rank does."""
        self._send_header(MOVE_KV, src.numel())
        send = self._send("other")
        send(src, torch.int64)
        send(dst, torch.int64)

    def capture(self, ks: tuple[int, ...], spec: bool, tree_nodes: int) -> None:
        """Before rank 0 captures its graphs: the others capture the same ones alongside.
        ks: the speculative step's draft lengths (spec: it has one); tree_nodes > 0: it
        verifies trees of that many nodes (ks is then (tree_nodes,))."""
        mask = 0 if tree_nodes or not spec else ks_mask(ks)
        self._send_header(CAPTURE, int(spec), mask, int(tree_nodes > 0), tree_nodes)

    def gather_embedding(self, embedding: torch.nn.Module) -> torch.Tensor:
        """The whole [vocab, hidden] embedding table on rank 0, from every rank's shard."""
        self._send_header(GATHER_EMBEDDING)
        return self.tp.all_gather(embedding.weight.data, dim=0)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._send_header(STOP)

    def _send(self, mode: str):
        def send(x: torch.Tensor, dtype: torch.dtype) -> None:
            x = x.contiguous()  # a speculative step's block tables are a column slice
            x = x.view(torch.uint8) if x.dtype == torch.bool else x.to(dtype)
            self.tp.broadcast(x, mode=mode)

        return send


def worker_loop(runner: ModelRunner) -> None:
    """A rank > 0 follows rank 0 until it sends STOP. runner: this rank's ModelRunner (its
    model shard and KV slice); it samples nothing."""

    tp: TPGroup = runner.tp
    header = torch.zeros(HEADER, dtype=torch.int64)
    dev = runner.device
    # A drafter split over the ranks (tp_workers.shard_drafter) follows rank 0's draft ops.
    follower = DraftFollower(runner) if runner.drafter is not None else None

    def recv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tp.broadcast(torch.empty(shape, dtype=dtype, device=dev))

    with torch.inference_mode():
        while True:
            tp.broadcast(header, control=True)
            op, *fields = header.tolist()
            if op == STOP:
                log.info("rank %d: stop from rank 0", tp.rank)
                return
            if op == FORWARD:
                seen = _forward(runner, recv, *fields[:10])
                if follower is not None and seen is not None:
                    follower.saw_forward(*seen)
            elif op in (DRAFT, DRAFT_AFTER_VERIFY):
                if follower is None:
                    raise RuntimeError(
                        f"rank {tp.rank}: rank 0 runs a sharded drafter but this rank holds "
                        "none: every rank must start with the same speculative config"
                    )
                if op == DRAFT:
                    follower.draft(recv, *fields[:7])
                else:
                    follower.after_verify(recv, *fields[:6])
            elif op == MOVE_KV:
                n = fields[0]
                src, dst = recv((n,), torch.int64), recv((n,), torch.int64)
                runner.kv_pool.move_no_sync(src, dst)
            elif op == GATHER_EMBEDDING:
                tp.all_gather(runner.model.model.embed_tokens.weight.data, dim=0)
            elif op == CAPTURE:
                spec, mask, tree, nodes = fields[:4]
                runner.follow_capture(ks_from_mask(mask), bool(spec), nodes if tree else 0)
            else:
                raise RuntimeError(f"rank {tp.rank}: unknown step op {op} from rank 0")


def _forward(
    runner: ModelRunner, recv, mode: int, t: int, b: int, w: int, m: int, n_logits: int, graph: int,
    key_mode: int, padded: int, per_seq: int,
):  # fmt: skip
    """-> (metadata, positions, aux streams) of an eager forward, for a sharded drafter; None
    after a graph replay (a sharded drafter runs with graphs off)."""
    layout = [((t,), torch.int64)] * 3
    if n_logits > 0:
        layout.append(((n_logits,), torch.int64))
    layout += [((b + 1,), torch.int32), ((b,), torch.int32), ((b, w), torch.int32)]
    if m:
        layout.append(((t, m), torch.uint8))
    parts = unpack(recv((packed_size(layout),), torch.uint8), layout)
    ids, positions, slots = parts[:3]
    rows = parts[3] if n_logits > 0 else None
    qsl, seq_lens, tables = parts[3 + (n_logits > 0) : 6 + (n_logits > 0)]
    if graph == SPEC_GRAPH:  # the verify graph computes every row's logits inside
        _spec_step(runner).graphs.replay_sent(per_seq - 1, ids, positions, slots, seq_lens, tables)
        return None
    if graph == TARGET_GRAPH:
        # A replay reads lengths from the device tensors only: no host read here, the host
        # lists just say how many sequences there are.
        meta = AttentionMetadata(
            mode=_MODES[mode], slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables, query_lens_cpu=[per_seq] * b, seq_lens_cpu=[0] * b,
        )  # fmt: skip
        hidden = _replay_target(runner, key_mode, padded, per_seq, ids, positions, meta)
        aux = None
    else:
        tree = parts[-1].view(torch.bool) if m else None
        starts = qsl.tolist()  # CPU-GPU sync point (the reference backend plans from host lengths)
        meta = AttentionMetadata(
            mode=_MODES[mode],
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            query_lens_cpu=[e - s for s, e in zip(starts, starts[1:])],
            seq_lens_cpu=seq_lens.tolist(),
            tree_mask=tree,
        )
        runner.backend.prepare(meta)
        with forward_context(ForwardContext(meta, runner.backend)):
            hidden, aux = runner.model(ids, positions, runner.aux_layers)
    if n_logits == ALL_ROWS:
        runner.model.compute_logits(hidden)
    elif rows is not None:
        runner.model.compute_logits(hidden[rows])
    return None if aux is None else (meta, positions, aux)


def _replay_target(
    runner: ModelRunner, mode: int, padded: int, per_seq: int, ids, positions, meta
) -> torch.Tensor:
    """The GraphRunner graph rank 0 replays -> hidden [T, H] of the real rows."""
    key = GraphKey(_MODES[mode], padded, per_seq)
    graphs = runner.graphs
    if graphs is None or key not in graphs.graphs:
        have = [] if graphs is None else list(graphs.graphs)
        raise RuntimeError(
            f"rank {runner.tp.rank}: rank 0 replays the CUDA graph {key}, which this rank did "
            f"not capture (it has {have}): the ranks captured different graphs; run with "
            "cuda_graphs=False (--enforce-eager) and report it"
        )
    inputs = ForwardInputs(ids, positions, meta, logits_indices=ids[:0])
    hidden, _ = graphs.replay(key, inputs)
    return hidden


def _spec_step(runner: ModelRunner) -> SpecStep:
    if runner.spec_step is None:
        raise RuntimeError(
            f"rank {runner.tp.rank}: rank 0 replays a speculative verify graph but this rank "
            "has no speculative step (no CAPTURE reached it): run with cuda_graphs=False "
            "(--enforce-eager) and report it"
        )
    return runner.spec_step
