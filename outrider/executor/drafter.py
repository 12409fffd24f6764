"""The EAGLE-3 drafter as the runner runs it: its network, its KV pool (same block ids as the
target's, one layer), and its forwards. The alignment of draft rows to target positions is
drawn in speculative/eagle3.py.

Two ways in:
- on the device, fixed shapes (executor/spec_step.py): `after_verify_no_sync` extends over a
  verify's rows and runs the chain from the row after the last accepted one, and
  `tree_after_verify_no_sync` extends over a tree's accepted path and grows the next tree, all
  inside graphs;
- eager and ragged (prefill steps, batches the step does not take): `observe` extends over what a step made valid and
  keeps a frontier per request, `propose` drafts chains or trees from it
  (speculative/eagle3_tree.py).

Under tensor parallelism the draft is whole on rank 0 (draft_tensor_parallel_size 1: no
collective in a draft forward, the target's embedding gathered there once) or split over every
rank like the target (`sharded`): rank 0's forwards then go out first as draft ops, which the
other ranks' drafters follow (executor/tp_draft.py), and their collectives count as "draft".
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Sequence

import torch

from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq, StepOutput
from outrider.executor.cuda_graph import GraphRunner
from outrider.executor.draft_sampling import SampledRows
from outrider.executor.draft_tree import grow_tree_no_sync
from outrider.executor.inputs import build_inputs, table_slots_no_sync
from outrider.executor.kv_cache import KVPool
from outrider.executor.tp_draft import send_after_verify, send_draft
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context
from outrider.layers.fused import top_logprobs
from outrider.models.eagle3 import Eagle3Draft
from outrider.speculative.base import SeqDrafts
from outrider.speculative.eagle3_tree import Frontier, propose_trees
from outrider.speculative.tree_batch import TreeShape
from outrider.transfer import to_device_no_sync

log = logging.getLogger(__name__)


SHARDED_GRAPHS = (
    "CUDA graphs with a drafter split over the ranks (draft_tensor_parallel_size > 1): the "
    "other ranks follow its forwards eagerly only; set cuda_graphs=False (--enforce-eager), or "
    "draft_tensor_parallel_size=1 (the drafter whole on rank 0)"
)


def _draft_collectives(method):
    """A sharded drafter's collectives inside `method` count as "draft", whatever forward
    context (prefill, verify, draft metadata) its forwards run under; nothing to do whole."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        if not self.sharded:
            return method(self, *args, **kwargs)
        with self.draft.tp.counting_as(ForwardMode.DRAFT.value):
            return method(self, *args, **kwargs)

    return counted


class Eagle3Drafter:
    """Satisfies `outrider.speculative.base.DeviceDrafter`."""

    name = "eagle3"
    on_device = True
    writes_kv = True  # chain steps write draft KV in the next verify's slots

    def __init__(
        self, draft: Eagle3Draft, runner, topk: int = 1, num_steps: int | None = None
    ) -> None:
        """runner: the target's ModelRunner (device, dtype, block size, backend, embedding).
        topk 1 drafts chains of k; topk > 1 grows trees of depth num_steps (speculative/eagle3_tree.py)."""
        self.draft = draft
        self.topk, self.num_steps = topk, num_steps
        # Weak: the runner owns this drafter (a strong reference back would be a cycle that
        # keeps the GPU memory of both until the cycle collector runs).
        self._runner = weakref.ref(runner)
        self.device, self.block_size = runner.device, runner.block_size
        cfg = draft.config
        target = runner.model_config
        if cfg.target_hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"the drafter was built for a target with hidden size {cfg.target_hidden_size} "
                f"and vocabulary {cfg.vocab_size}, but the target has {target.hidden_size} and "
                f"{target.vocab_size}: use a drafter trained for this model "
                "(`outrider drafter train`), or check it with `outrider drafter doctor`"
            )
        if max(cfg.aux_layers) >= target.num_hidden_layers:
            raise ValueError(
                f"drafter aux layers {cfg.aux_layers} exceed the target's "
                f"{target.num_hidden_layers} layers: it was trained for another model"
            )
        self.aux_layers = tuple(cfg.aux_layers)
        # Split over the target's ranks, every rank running each draft forward; else whole,
        # on rank 0 alone.
        self.sharded = draft.tp.size > 1
        if self.sharded and draft.tp is not runner.tp:
            raise ValueError(
                f"the drafter is split over a group of {draft.tp.size} ranks that is not the "
                f"target's ({runner.tp.size} ranks): build it with tp=runner.tp, or whole"
            )
        # Rank 0 of a sharded drafter sends each draft forward to the other ranks first; they
        # read its inputs in the runner's dtype.
        self._sender = runner.tp_sender if self.sharded else None
        if self.sharded and draft.fc.weight.dtype != runner.dtype:
            raise ValueError(
                f"a sharded drafter in {draft.fc.weight.dtype} beside a target in "
                f"{runner.dtype}: load it in the target's dtype (build_eagle3_drafter does)"
            )
        # The sharded drafter embeds with the target's own shard (its all-reduce is a draft
        # collective); a drafter on rank 0 alone with the whole table, gathered once.
        embed = runner.model.model.embed_tokens if self.sharded else runner.embedding_for_drafter()
        draft.bind_embedding(embed)
        layout = draft.kv_layout(runner.dtype)
        # Same block ids as the target's pool (+1 scratch block, as there), within the budget
        # the target's was sized to where it still can be (engine start-up).
        runner.make_room_for(layout.bytes_per_token * self.block_size)
        self.kv_pool = KVPool(layout, 1, runner.num_blocks + 1, self.block_size, self.device)
        draft.attention_layers()[0].kv_cache = self.kv_pool.layer(0)
        self._frontier: dict[str, Frontier] = {}
        self._deferred: dict[str, _Deferred] = {}  # rows of plain steps not extended over yet
        self._graphs: GraphRunner | None = None

    # -- after every target forward ---------------------------------------------------------

    @torch.inference_mode()
    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """EXTEND the draft over the rows this step made valid (call after postprocess), after
        the rows deferred before them."""
        self.catch_up()
        rows: list[int] = []
        seqs: list[ScheduledSeq] = []
        for s, own in _valid_rows(batch, output):
            rows += own
            nxt = s.request.all_token_ids[s.start_pos + 1 : s.start_pos + 1 + len(own)]
            seqs.append(ScheduledSeq(s.request, nxt, s.start_pos, s.request.block_ids, True))
        if not seqs:
            return
        rows_t = to_device_no_sync(rows, torch.int64, output.aux_hidden.device)
        self._extend(seqs, output.aux_hidden[rows_t], rows_t)

    def defer(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Keep the aux rows this step made valid (a view, or a gather along an accepted path;
        no forward, no sync) and extend over them at the next `catch_up`, which the next step
        that drafts runs first. The engine defers after a plain step while speculation is off
        (skipping those rows left the draft KV there stale, so the controller's probes verified
        drafts far worse than the drafter's, 29% accepted on 2 CPU cores, and speculation
        stayed off where it paid) and after a prefill step (a prompt's first token then leaves
        without waiting for a draft forward over the prompt). A request holding rows of
        _MAX_DEFERRED_STEPS steps catches up at once: the rows are views that keep each step's
        aux tensor alive."""
        full = False
        for s, own in _valid_rows(batch, output):
            req = s.request
            if own[-1] - own[0] + 1 == len(own):
                rows = output.aux_hidden[own[0] : own[-1] + 1]
            else:
                at = to_device_no_sync(own, torch.int64, output.aux_hidden.device)
                rows = output.aux_hidden[at]
            run = self._deferred.get(req.request_id)
            if run is None or run.end != s.start_pos:  # a new run (a first, or after a gap)
                run = self._deferred[req.request_id] = _Deferred(req, s.start_pos)
            run.add(rows)
            full |= len(run.parts) >= _MAX_DEFERRED_STEPS
        if full:
            self.catch_up()

    @torch.inference_mode()
    def catch_up(self) -> None:
        """EXTEND the draft over every row `defer` kept, in one forward: before anything reads
        the draft KV (the speculative step, `observe`, `propose`)."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, {}
        seqs: list[ScheduledSeq] = []
        parts: list[torch.Tensor] = []
        for run in deferred.values():
            req = run.request
            # Each row's next token; rows the target has not computed yet are not there.
            nxt = req.all_token_ids[run.start + 1 : min(run.end, req.num_computed_tokens) + 1]
            if req.is_finished or not req.block_ids or not nxt:
                continue
            seqs.append(ScheduledSeq(req, nxt, run.start, req.block_ids, sample=True))
            parts.append(torch.cat(run.parts)[: len(nxt)])
        if seqs:
            self._extend(seqs, torch.cat(parts))

    def _extend(
        self,
        seqs: list[ScheduledSeq],
        hidden: torch.Tensor,  # [rows, n_aux * Ht], the seqs' rows in order
        aux_rows: torch.Tensor | None = None,  # [rows]: hidden is these rows of the last aux
    ) -> None:
        """One draft forward over the seqs' rows (their KV written), and each one's frontier."""
        batch = ScheduledBatch(ForwardMode.PREFILL, seqs)
        logits, last_hidden = self._run(batch, hidden, aux_rows=aux_rows)
        top_logp, top = top_logprobs(logits, self.topk)
        top_ids = self.draft.to_target_ids(top)
        for i, s in enumerate(seqs):
            keep = None if s.request.params.greedy else logits[i]
            self._frontier[s.request.request_id] = Frontier(
                s.context_len - 1, top_ids[i], top_logp[i], last_hidden[i], keep
            )

    # -- the engine's proposal call ---------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        self.catch_up()
        live = [
            (i, r)
            for i, r in enumerate(requests)
            if (f := self._frontier.get(r.request_id)) is not None
            and f.position == r.num_computed_tokens - 1
        ]
        out = [SeqDrafts([], []) for _ in requests]
        if not live or max_draft_tokens < 1:
            return out
        reqs = [r for _, r in live]
        frontiers = [self._frontier[r.request_id] for r in reqs]
        if self.topk > 1:
            trees = propose_trees(self, reqs, frontiers, max_draft_tokens)
            for (i, _), tree in zip(live, trees):
                out[i] = tree
            return out
        steps = [torch.stack([f.top_ids[0] for f in frontiers])]  # [B]
        hidden = torch.stack([f.hidden for f in frontiers])  # [B, H]
        sampling = SampledRows(self, reqs)
        if sampling:
            first = torch.stack([frontiers[i].logits for i in sampling.index])
            steps[0] = sampling.draw(steps[0], first)
        graphs = self._draft_graphs()
        for j in range(2, max_draft_tokens + 1):
            seqs = [
                ScheduledSeq(r, [0], r.num_computed_tokens + j - 2, r.block_ids, sample=True)
                for r in reqs
            ]
            inputs = build_inputs(
                ScheduledBatch(ForwardMode.DRAFT, seqs), self.block_size, self.device
            )
            inputs.input_ids = steps[-1]
            key = graphs.can_run(inputs) if graphs is not None else None
            if key is not None:
                tokens, hidden, logits = graphs.replay(key, inputs, {"hidden": hidden})
                # Views of the graph's static outputs: the next replay overwrites them, and
                # `steps` keeps every step's ids (hidden is copied in before that replay).
                tokens = tokens.clone()
            else:
                logits, hidden = self.run_rows(
                    inputs.input_ids, inputs.positions, inputs.attn, hidden, inputs.logits_indices
                )
                tokens = self.draft.to_target_ids(logits.argmax(dim=-1))
            steps.append(sampling.draw(tokens, logits) if sampling else tokens)
        drafts = torch.stack(steps, dim=1).tolist()  # [B, k]  # CPU-GPU sync point
        probs = sampling.per_request() if sampling else {}
        for b, ((i, _), ids) in enumerate(zip(live, drafts)):
            out[i] = SeqDrafts.chain(ids, probs.get(b))
        return out

    def forget(self, request_id: str) -> None:
        self._frontier.pop(request_id, None)
        self._deferred.pop(request_id, None)

    def positions_needed(self, k: int) -> int:
        """Slots from position C (the root's) that proposing k drafts and verifying them use:
        the verify's root + k drafts, and a tree's frontier nodes (topk per step but the last)."""
        steps = self.num_steps or k
        return max(1 + k, (steps - 1) * self.topk if self.topk > 1 else 0)

    # -- on the device, fixed shapes (the speculative step) --------------------------------

    @_draft_collectives
    def after_verify_no_sync(
        self,
        meta: AttentionMetadata,  # the verify's: [B, t] rows, t = 1 + k
        next_ids: torch.Tensor,  # [B * t] the target's argmax at each row (its next token)
        positions: torch.Tensor,  # [B * t]
        aux: torch.Tensor,  # [B * t, 3 * Ht] the target's aux streams at each row
        num_accepted: torch.Tensor,  # [B]
        starts: torch.Tensor,  # [B] each row's root position
        block_tables: torch.Tensor,  # [B, W] int32, padded with the scratch block
        k_draft: int,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [B, k_draft] int64 next drafts
        """Extend over every verify row (rows past the accepted ones write draft KV the chain
        overwrites before anyone reads it), then chain from row num_accepted. No host sync."""
        if self._sender is not None:
            send_after_verify(self._sender, next_ids, num_accepted, k_draft)
        b = starts.shape[0]
        t = next_ids.shape[0] // b
        own = AttentionMetadata(
            meta.mode, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.query_lens_cpu, meta.seq_lens_cpu,
        )  # fmt: skip
        backend.prepare(own)
        with forward_context(ForwardContext(own, backend)):
            normed, summed = self.draft(next_ids, positions, aux)
        rows = torch.arange(b, device=starts.device) * t + num_accepted
        logits = self.draft.compute_logits(normed.index_select(0, rows))
        first = self.draft.to_target_ids(logits.argmax(dim=-1))
        hidden = summed.index_select(0, rows)
        return self.chain_no_sync(first, hidden, starts + num_accepted + 1, block_tables,
                                  k_draft, backend)  # fmt: skip

    def chain_no_sync(
        self,
        first: torch.Tensor,  # [B] the first draft (predicted at position C - 1)
        hidden: torch.Tensor,  # [B, H] the draft's pre-norm output there
        first_pos: torch.Tensor,  # [B] C: where chain step 2 runs
        block_tables: torch.Tensor,  # [B, W] int32; its last column is the scratch block
        k_draft: int,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [B, k_draft]
        """Chain steps 2..k_draft, positions and slots computed on the device: step j runs at
        C + j - 2 and sees the draft KV of positions <= its own. A position past the table
        (the context's end) lands on the scratch block: a worse draft, never a wrong token."""
        b = first.shape[0]
        bs, width = self.block_size, block_tables.shape[1]
        top = self.draft.rotary_emb.cos.shape[0] - 1
        qsl = torch.arange(b + 1, dtype=torch.int32, device=first.device)
        out, ids = [first], first
        for j in range(2, k_draft + 1):
            pos = first_pos + (j - 2)
            slots = table_slots_no_sync(block_tables, pos[:, None], bs).squeeze(1)
            lens = (pos + 1).to(torch.int32)
            meta = AttentionMetadata(
                ForwardMode.DRAFT, slots, qsl, lens, block_tables, [1] * b, [width * bs] * b
            )
            backend.prepare(meta)
            with forward_context(ForwardContext(meta, backend)):
                normed, hidden = self.draft(ids, pos.clamp(max=top), hidden)
            ids = self.draft.to_target_ids(self.draft.compute_logits(normed).argmax(dim=-1))
            out.append(ids)
        return torch.stack(out, dim=1)

    @_draft_collectives
    def tree_after_verify_no_sync(
        self,
        path_ids: torch.Tensor,  # [B, 1 + S]
        path_aux: torch.Tensor,  # [B * (1 + S), 3 * Ht]
        num_accepted: torch.Tensor,  # [B]
        starts: torch.Tensor,  # [B]
        block_tables: torch.Tensor,  # [B, W] int32
        shape: TreeShape,
        backend: AttentionBackend,
        path_rows: torch.Tensor | None = None,  # [B, 1 + S] verify rows of the path (sharded)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree step's drafting, all on the device: extend over the accepted path, then grow
        the next tree EAGLE-2 style. Arguments and the (tokens [B, N], parents [B, N]) it
        returns: executor/draft_tree.py's grow_tree_no_sync."""
        if self._sender is not None:  # the other ranks gather their own aux along path_rows
            send_after_verify(self._sender, path_ids, num_accepted, 0, path_rows, shape)
        return grow_tree_no_sync(
            self.draft, self.block_size, path_ids, path_aux, num_accepted, starts, block_tables,
            shape, backend,
        )  # fmt: skip

    # -- one draft forward ------------------------------------------------------------------

    def _draft_graphs(self) -> GraphRunner | None:
        """DRAFT graphs for chain steps (one token per sequence), through the same graph runner
        as the target's, captured on first use where the target runs graphs."""
        if self._graphs is None and self._runner().graphs is not None:
            if self.sharded:
                raise ValueError(SHARDED_GRAPHS)
            target = self._runner().graphs
            self._graphs = GraphRunner(
                self.draft, self._runner().backend, max_blocks=target.max_blocks,
                scratch_block=target.scratch_block, block_size=self.block_size,
                batch_sizes=target.batch_sizes, tokens_per_seq=(1,), step=_chain_step(self.draft),
                extra_widths={"hidden": (self.draft.config.hidden_size, self._runner().dtype)},
                mode=ForwardMode.DRAFT,
            )  # fmt: skip
            self._graphs.capture()
        return self._graphs

    def _run(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,  # [num_tokens, 3 * Ht] or [num_tokens, H]
        input_ids: torch.Tensor | None = None,  # [num_tokens] on the device; None: batch's ids
        aux_rows: torch.Tensor | None = None,  # [num_tokens]: hidden is these aux rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft logits at each seq's last row [B, draft_vocab], pre-norm hidden there [B, H])."""
        inputs = build_inputs(batch, self.block_size, self.device)
        ids = inputs.input_ids if input_ids is None else input_ids
        return self.run_rows(
            ids, inputs.positions, inputs.attn, hidden, inputs.logits_indices, aux_rows
        )

    @_draft_collectives
    def run_rows(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        hidden: torch.Tensor,  # [T, 3 * Ht] or [T, H]
        rows: torch.Tensor,  # [R]
        aux_rows: torch.Tensor | None = None,  # [T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward -> (draft logits [len(rows), draft_vocab], pre-norm [len(rows), H])
        at `rows`. aux_rows ([T] int64): `hidden` is those rows of the last target forward's aux
        streams, which a sharded drafter's other ranks hold already (else hidden is sent)."""
        if self._sender is not None:
            sent = None if aux_rows is not None else hidden
            send_draft(
                self._sender, ids, positions, meta, rows, sent, aux_rows, self.draft.fc.weight.dtype
            )
        backend = self._runner().backend
        backend.prepare(meta)
        with forward_context(ForwardContext(meta, backend)):
            normed, summed = self.draft(ids, positions, hidden)
        return self.draft.compute_logits(normed[rows]), summed[rows]


_MAX_DEFERRED_STEPS = 64  # steps' rows a request keeps before catching up (GPU: 100 MB at
# most for an 8B target at 64 sequences)


def _valid_rows(batch: ScheduledBatch, output: StepOutput):
    """(seq, its rows of the step's output) for each live request: the rows this step made
    valid, one a position from seq.start_pos on (the root and the accepted path of a verify,
    else every row the target computed), each with its next token in the request's tokens."""
    if output.aux_hidden is None:
        raise RuntimeError("the target forward returned no aux hidden states for EAGLE-3")
    row0 = sampled = 0
    for s in batch.seqs:
        req = s.request
        if s.drafts is not None:
            own = [row0] + [row0 + 1 + n for n in output.accepted_nodes[sampled]]
        else:
            own = list(range(row0, row0 + s.query_len))
        row0 += s.query_len
        sampled += s.sample
        if req.is_finished or not req.block_ids:
            continue
        # Each row's next token: the prompt's, the sampled one, or an accepted draft.
        own = own[: max(0, min(req.num_tokens, req.num_computed_tokens + 1) - s.start_pos - 1)]
        if own:
            yield s, own


class _Deferred:
    """A request's deferred rows from position `start` on, in order, up to `end`."""

    def __init__(self, request: Request, start: int) -> None:
        self.request, self.start, self.end = request, start, start
        self.parts: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> None:
        self.parts.append(rows)
        self.end += rows.shape[0]


def _chain_step(draft: Eagle3Draft):
    """One chain step for a DRAFT graph, all on the device: -> (next draft's target id [B],
    pre-norm hidden [B, H], draft logits [B, draft_vocab] for requests that sample). A closure over the draft, not the proposer: the graph runner
    holding it must not keep the proposer (and the engine) alive in a reference cycle."""

    def step(ids, positions, extras) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed, summed = draft(ids, positions, extras["hidden"])
        logits = draft.compute_logits(normed)
        return draft.to_target_ids(logits.argmax(dim=-1)), summed, logits

    return step


def build_eagle3_drafter(config, runner, checkpoint=None) -> Eagle3Drafter:
    """config: SpecConfig. Loads config.draft (or the drafter shipped for the default model)
    after the doctor's static checks against the target (checkpoint: its config and tokenizer):
    a drafter for another model or tokenizer is refused here, not discovered as accept length 1."""
    from pathlib import Path

    from outrider.loaders.checkpoint import hf_cache_snapshot, is_repo_id
    from outrider.models.eagle3_io import load_drafter
    from outrider.speculative.eagle3 import shipped_drafter
    from outrider.speculative.eagle3_doctor import require_fit

    path = config.draft or shipped_drafter(runner.model_config)
    if not Path(path).expanduser().exists() and is_repo_id(str(path)):
        path = str(hf_cache_snapshot(str(path)))  # a published drafter's repo id, cached
    if checkpoint is not None:
        require_fit(path, checkpoint, f"refusing EAGLE-3 drafter {path} for this model",
                    "train one for it with `outrider drafter train`")  # fmt: skip
    # draft_tensor_parallel_size is 1 or the target's (config.py): split like the target.
    tp = runner.tp if config.draft_tensor_parallel_size > 1 else None
    draft = load_drafter(path, runner.model_config, device=runner.device, dtype=runner.dtype, tp=tp)
    # deterministic=True leaves the drafter's kernels as they are: drafts never decide the
    # output (a greedy row emits the target's argmax, a seeded sampled row the draw keyed by
    # its seed and position, and an unseeded one has no output to reproduce), so only the
    # target's rows must not depend on the batch. Batch-invariant, the draft's three chain
    # steps cost EAGLE-3 a quarter of its speedup on the H100 (1.77x plain against 2.35x at C=1).
    log.info("EAGLE-3 drafter %s, aux layers %s", path, draft.config.aux_layers)
    return Eagle3Drafter(draft.eval(), runner, topk=config.topk, num_steps=config.num_steps)
