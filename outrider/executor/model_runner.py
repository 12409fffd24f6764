"""Builds the model, loads its weights, allocates its KV pool, and runs one ScheduledBatch."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from outrider.config import EngineConfig
from outrider.core import (
    ForwardMode,
    LaunchedGrammar,
    ScheduledBatch,
    ScheduledSeq,
    StepOutput,
)
from outrider.device import default_dtype, resolve_device, resolve_dtype
from outrider.distributed import TPGroup, single
from outrider.executor import step_timing, tp_graphs
from outrider.executor.cuda_graph import DEFAULT_BATCH_SIZES, PREFILL_TOKENS, GraphRunner
from outrider.executor.inputs import ForwardInputs, build_inputs
from outrider.executor.kv_cache import KVPool, num_blocks_for_budget
from outrider.executor.sampler import (
    Sampler,
    apply_token_bitmask_,
    token_bitmask,
    top_candidates,
    top_candidates_no_sync,
)
from outrider.executor.spec_step import SpecStep
from outrider.executor.token_drafts import TokenStepDrafter, token_pool, write_tokens_no_sync
from outrider.executor.tp_channel import TARGET_GRAPH, StepSender
from outrider.executor.verify_step import sample_and_verify, tree_kv_slots
from outrider.layers.attn_backends.base import get_backend
from outrider.layers.forward_context import ForwardContext, forward_context
from outrider.loaders.checkpoint import Checkpoint
from outrider.models.deterministic import make_batch_invariant
from outrider.models.registry import model_class
from outrider.models.weights import load_weights
from outrider.progress import progress
from outrider.speculative.base import TokenDrafter
from outrider.speculative.tree_batch import TreeShape
from outrider.transfer import to_device_no_sync

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, checkpoint: Checkpoint, tp: TPGroup | None = None
    ) -> None:
        """tp: the tensor-parallel group this rank's shard of the model belongs to (None: one
        rank). Rank 0 sends every forward's inputs to the others (executor/tp_channel.py);
        ranks > 0 run `tp_channel.worker_loop` on this runner instead of `run`."""
        self.config = config
        self.model_config = cfg = checkpoint.config
        self.tp = tp = tp or single()
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_model_len = _max_model_len(config.model.max_model_len, cfg)
        self.block_size = config.cache.block_size

        with torch.device(self.device), default_dtype(self.dtype):
            self.model = model_class(cfg.architecture)(cfg, max_positions=self.max_model_len, tp=tp)
        load_weights(self.model, progress(checkpoint.iter_tensors(), "loading weights"))
        self.model.eval()
        if config.model.deterministic:
            make_batch_invariant(self.model)

        # The model says what a token slot holds (this rank's multi-head K/V, or one MLA
        # latent); every rank's pool has as many blocks as the smallest one, since rank 0's
        # block manager hands out ids for all of them.
        layout = self.model.kv_layout(self.dtype)
        attention = self.model.attention_layers()
        num_blocks = num_blocks_for_budget(layout, len(attention), config.cache, self.device)
        num_blocks = tp.agree_min(num_blocks)
        # Rank 0 of several: every target forward's inputs go to the other ranks first.
        self.tp_sender = StepSender(tp) if tp.size > 1 and tp.rank == 0 else None
        self._whole_embedding: Callable[[torch.Tensor], torch.Tensor] | None = None
        # One block more than the block manager hands out: padded graph rows write there.
        self._num_blocks = num_blocks
        self._kv_handed_out = False  # hand_out_kv
        self.kv_pool = KVPool(layout, len(attention), num_blocks + 1, self.block_size, self.device)
        for i, attn in enumerate(attention):
            attn.kv_cache = self.kv_pool.layer(i)
        self.backend = get_backend(
            config.model.attention_backend, self.device.type, latent=layout.is_latent,
            deterministic=config.model.deterministic,
        )  # fmt: skip
        # Layers whose input residual stream every forward returns, for a drafter or a host
        # proposer that reads them (set_speculation, set_aux_layers, set_drafter_shard).
        self.aux_layers: tuple[int, ...] = ()
        self.sampler = Sampler()
        self.graphs: GraphRunner | None = None  # capture_graphs(), once aux_layers are known
        # Speculation: the drafter network the runner owns (EAGLE-3; None for n-gram, whose
        # drafts come from the host) and the fixed-shape chain step (set_speculation).
        self.drafter = None
        self.spec_step: SpecStep | None = None
        # The token at each KV slot, written by every forward, for a drafter that drafts
        # inside the step from tokens alone (executor/token_drafts.py); None without one.
        self.token_pool: torch.Tensor | None = None
        self.spec_ks: tuple[int, ...] = ()
        log.info(
            "model %s on %s/%s (tensor-parallel rank %d of %d): KV pool %d blocks x %d tokens "
            "(%.1f MiB)",
            cfg.architecture,
            self.device,
            self.dtype,
            tp.rank,
            tp.size,
            num_blocks,
            self.block_size,
            self.kv_pool.nbytes / 2**20,
        )

    @property
    def num_blocks(self) -> int:
        """Blocks the block manager may hand out (the pool holds one more, a scratch block)."""
        return self._num_blocks

    def make_room_for(self, bytes_per_block: int) -> None:
        """Shrink the KV pool so that a second pool of as many blocks, `bytes_per_block` each
        (a drafter's, whose block ids are the target's), fits in the budget this one was sized
        to. Beside an MLA target's latents a drafter's multi-head KV is no small share
        (Moonlight's 27 layers of latents: 31 KB a token; its EAGLE-3 layer's 16 heads: 8 KB),
        and a pool sized to the whole budget left it no room (an H200 at
        gpu_memory_utilization 0.9 held back 14 GB for a 25 GB drafter pool).

        Only where the budget sized the pool (cache.num_blocks unset), on one rank, and before
        anything holds its blocks (`hand_out_kv`: the block manager, the graphs); else
        nothing changes."""
        if self.config.cache.num_blocks is not None or self.tp.size > 1 or self._kv_handed_out:
            return
        own = self.kv_pool.nbytes // (self._num_blocks + 1)
        blocks = self._num_blocks * own // (own + bytes_per_block)
        if blocks < 2:
            raise ValueError(
                f"the KV budget holds {self._num_blocks} blocks of the model's {own} bytes, and "
                f"beside a drafter's {bytes_per_block} bytes a block only {blocks}: raise "
                f"gpu_memory_utilization (or cpu_kv_bytes) or lower max_model_len"
            )
        layout, attention = self.kv_pool.layout, self.model.attention_layers()
        for attn in attention:
            attn.kv_cache = {}
        self.kv_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old pool back with the device before the new one
        self.kv_pool = KVPool(layout, len(attention), blocks + 1, self.block_size, self.device)
        for i, attn in enumerate(attention):
            attn.kv_cache = self.kv_pool.layer(i)
        log.info(
            "KV pool %d blocks (from %d): a drafter's pool of %d bytes a block shares the budget",
            blocks, self._num_blocks, bytes_per_block,
        )  # fmt: skip
        self._num_blocks = blocks

    def hand_out_kv(self) -> None:
        """The pool's blocks are in use from now on (the engine's block manager holds their
        ids): make_room_for no longer shrinks it."""
        self._kv_handed_out = True

    def embedding_for_drafter(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The target's token embedding as a drafter on rank 0 uses it (ids [T] -> [T, H]): the
        layer itself on one rank; under tensor parallelism the whole table, gathered from the
        shards once, since the sharded layer all-reduces and a drafter on rank 0 alone must
        not (the other ranks would never join)."""
        if self.tp_sender is None:
            return self.model.model.embed_tokens
        if self._whole_embedding is None:
            weight = self.tp_sender.gather_embedding(self.model.model.embed_tokens)
            self._whole_embedding = functools.partial(F.embedding, weight=weight)
        return self._whole_embedding

    def collective_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """{mode: {collective: {"calls", "bytes"}}} this rank ran, plus {"forward": {"calls":
        n}} per mode under tensor parallelism: a forward's share is calls / n. Empty on one
        rank."""
        counts = self.tp.counts()
        if self.tp_sender is not None:
            for mode, n in self.tp_sender.forwards.items():
                counts.setdefault(mode, {})["forward"] = {"calls": n, "bytes": 0}
        return counts

    def reset_collective_counts(self) -> None:
        self.tp.reset_counts()
        if self.tp_sender is not None:
            self.tp_sender.forwards.clear()

    def shutdown(self) -> None:
        """Release the other ranks from their loop (rank 0 of several; else nothing)."""
        if self.tp_sender is not None:
            self.tp_sender.stop()

    def set_speculation(self, drafter, ks: tuple[int, ...], tree: TreeShape | None = None) -> None:
        """Chain speculation at the draft lengths `ks` (each a k >= 1 the step may be asked to
        verify), or trees of one shape (`tree`; ks is then (tree.num_nodes,)). drafter: an
        EAGLE-3 drafter the runner runs inside the step (every target forward keeps its aux
        streams), a TokenDrafter whose lookup the step runs over the tokens every forward
        keeps (executor/token_drafts.py), or None (chain drafts come from the host). Call
        before capture_graphs."""
        if tree is not None and self.backend.deterministic and not self.backend.deterministic_trees:
            raise ValueError(
                f"deterministic=True with tree speculation (topk > 1): the {self.backend.name} "
                "attention backend computes tree rows over masked key tiles, not as a decode "
                "row; use a chain (topk 1), or deterministic=False"
            )
        if isinstance(drafter, TokenDrafter):
            if tree is not None:
                raise ValueError("a TokenDrafter drafts chains: use topk 1")
            # Kept from an earlier one: blocks the prefix cache holds keep their tokens. (A
            # pool made after forwards ran without one reads zeros in blocks cached before:
            # poorer drafts there, the same output.)
            if self.token_pool is None:
                slots = self.kv_pool.num_blocks * self.block_size
                self.token_pool = token_pool(slots, self.device)
            drafter = TokenStepDrafter(drafter, self.token_pool, self.block_size)
        else:
            self.token_pool = None
        self.drafter = drafter
        self.aux_layers = tuple(drafter.aux_layers) if drafter is not None else ()
        self._set_spec_step(drafter, ks, tree)

    def set_aux_layers(self, layers: Sequence[int]) -> None:
        """Every target forward (`run`, `launch`) also returns the residual streams entering
        `layers` (StepOutput.aux_hidden), for a proposer that drafts on the host from them; ()
        for none. The drafter and the speculative step stay as they are (a drafter the step
        runs has its layers set by set_speculation). Call before capture_graphs: the graphs
        output these streams too."""
        self.aux_layers = tuple(layers)

    def set_drafter_shard(self, drafter) -> None:
        """A rank > 0 of an engine whose drafter is split over the ranks: this rank's shard of
        it (an Eagle3Drafter over the sharded draft), which runs only when rank 0 sends a draft
        op (tp_draft.DraftFollower). Every target forward keeps its aux streams, and
        follow_capture keeps both."""
        self.drafter = drafter
        self.aux_layers = drafter.aux_layers

    def _set_spec_step(self, drafter, ks: tuple[int, ...], tree: TreeShape | None) -> None:
        """The speculative step alone (set_speculation's; follow_capture's without a drafter):
        its verify forwards keep `drafter`'s aux streams, whatever this runner's own are."""
        self.spec_ks = (tree.num_nodes,) if tree is not None else tuple(sorted(set(ks)))
        max_k = max(self.spec_ks)
        self.spec_step = SpecStep(
            self.model, self.backend, drafter, max_k=max_k, block_size=self.block_size,
            max_blocks=-(-self.max_model_len // self.block_size), scratch_block=self._num_blocks,
            max_positions=self.max_model_len, batch_sizes=self._graph_batch_sizes(),
            aux_layers=tuple(drafter.aux_layers) if drafter is not None else (),
            tree=tree, kv_pool=self.kv_pool, sender=self.tp_sender, tp=self.tp,
            token_pool=self.token_pool,
        )  # fmt: skip

    def _graph_batch_sizes(self) -> tuple[int, ...]:
        top = self.config.model.cuda_graph_max_batch
        return tuple(b for b in DEFAULT_BATCH_SIZES if b < top) + (top,)

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs the config asks for (after `aux_layers` is set: the graphs
        output those streams too), the speculative step's too. A no-op where graphs do not
        apply. Rank 0 of several has the other ranks capture the same ones alongside
        (follow_capture; executor/tp_graphs.py)."""
        if self.tp_sender is not None:
            step = self.spec_step
            tree = step.tree.num_nodes if step is not None and step.tree is not None else 0
            self.tp_sender.capture(self.spec_ks, step is not None, tree)
        self._kv_handed_out = True  # the graphs hold the pool's addresses
        self._capture()

    def follow_capture(self, ks: tuple[int, ...], spec: bool, tree_nodes: int) -> None:
        """A rank > 0, on rank 0's CAPTURE (tp_channel.worker_loop): the same speculative step
        (draft lengths `ks` when `spec`), without a drafter since rank 0 drafts, then the same
        graphs. Trees (`tree_nodes` > 0) keep no step here: they verify eagerly under tensor
        parallelism, through the forwards rank 0 sends. A split drafter's shard
        (set_drafter_shard) stays, and so do the aux streams every target forward keeps for
        it; such a runner captures no graphs."""
        if spec and not tree_nodes:
            self._set_spec_step(None, ks, None)
        else:
            self.spec_step = None
            self.spec_ks = (tree_nodes,) if tree_nodes else ()
        self._capture()

    def _capture(self) -> None:
        """The graphs this runner replays; under tensor parallelism every rank runs this at the
        same point (rank 0 from capture_graphs, the others from follow_capture), and the ranks
        agree on what they capture first."""
        self.graphs = graphs = self.graph_runner()
        step = self.spec_step.graphs if graphs is not None and self.spec_step else None
        tp_graphs.agree_on_captures(self.tp, graphs, step, self.spec_ks, self.device)
        if graphs is not None:
            graphs.capture()
            if step is not None:
                step.capture(self.spec_ks)

    def graph_runner(self) -> GraphRunner | None:
        """The target's graph runner the config asks for, not captured yet; None where graphs
        do not apply. The same on every rank: it reads only the config, the model and the
        device type."""
        config = self.config
        wanted = config.model.cuda_graphs
        # A model whose forward reads the host (the reference MoE picks experts there) says so,
        # and one that reads none only up to a step size (the fused MoE) says which: the
        # largest graph, every batch size's top times its tokens per sequence, must fit.
        model_ok, limit = self.model.graph_safe, self.model.graph_max_tokens
        tokens_per_seq = 1
        if config.speculative.enabled:  # chain verifies 1 + k rows a sequence, trees 1 + nodes
            tokens_per_seq += max((config.speculative.num_draft_tokens, *self.spec_ks))
        most = self._graph_batch_sizes()[-1] * tokens_per_seq
        if model_ok and limit is not None and most > limit:
            log.info("CUDA graphs off: steps of %d tokens pass the model's %d", most, limit)
            model_ok = False
        usable = (
            self.device.type == "cuda"
            and ForwardMode.DECODE in self.backend.graph_modes
            and model_ok
        )
        if wanted is False or (wanted is None and (not usable or self.backend.name != "triton")):
            return None
        if config.speculative.draft_tensor_parallel_size > 1:  # cuda_graphs=True: refused
            # The other ranks follow a split drafter's forwards eagerly only.
            log.info("CUDA graphs off: the drafter is split over the ranks")
            return None
        if wanted is None and self.tp.size > 1:
            # Opt-in until several GPUs have run them (tests/gpu/test_tp_graphs_cuda.py): one
            # GPU has checked NCCL collectives under capture, not a model split over GPUs.
            log.info(
                "tensor parallelism: CUDA graphs are opt-in at TP > 1; cuda_graphs=True "
                "(YAML model: {cuda_graphs: true}) captures the same graphs on every rank"
            )
            return None
        if not usable:
            raise ValueError(
                f"cuda_graphs=True needs device cuda, a graph-safe attention backend and a "
                f"graph-safe model; got device={self.device}, backend={self.backend.name}, "
                f"{self.model_config.architecture} graph-safe: {model_ok} (graph steps of up "
                f"to {most} tokens, the model's limit {limit}): set cuda_graphs=False, or "
                f"lower cuda_graph_max_batch or num_draft_tokens"
            )
        sizes = self._graph_batch_sizes()
        tpq = (1,)
        if config.speculative.enabled and ForwardMode.VERIFY in self.backend.graph_modes:
            tpq = (1, 1 + config.speculative.num_draft_tokens)
        return GraphRunner(
            self.model,
            self.backend,
            max_blocks=-(-self.max_model_len // self.block_size),
            scratch_block=self._num_blocks,
            block_size=self.block_size,
            batch_sizes=sizes,
            tokens_per_seq=tpq,
            aux_layers=self.aux_layers,
            tp=self.tp,
            prefill_tokens=self._prefill_graph_tokens(limit),
            mixed_prefill=config.model.cuda_graph_mixed_prefill,
        )

    def _prefill_graph_tokens(self, limit: int | None) -> tuple[int, ...]:
        """Token counts of the PREFILL graphs (GraphRunner.prefill_tokens): 32, 64, ... up to
        cuda_graph_prefill_tokens (no step holds more than max_num_batched_tokens, nor may a
        graph pass the model's `limit`); none where a prefill reads the host: a backend
        without PREFILL graphs, MLA latents (their prefill expands them in PyTorch), the
        deterministic mode's chunk plans, or ranks that would each capture their own."""
        config = self.config
        if (
            ForwardMode.PREFILL not in self.backend.graph_modes
            or self.model.kv_layout(self.dtype).is_latent
            or config.model.deterministic
            or self.tp.size > 1
        ):
            return ()
        top = min(config.model.cuda_graph_prefill_tokens, config.scheduler.max_num_batched_tokens)
        if limit is not None:
            top = min(top, limit)
        if top < 1:
            return ()
        return tuple(t for t in PREFILL_TOKENS if t < top) + (top,)

    @torch.inference_mode()
    def forward(
        self,
        batch: ScheduledBatch,
        aux_layers: Sequence[int] = (),
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], ForwardInputs]:
        """One forward over the batch's tokens: final hidden [num_tokens, hidden], the residual
        streams entering `aux_layers`, and the inputs (for logits_indices). `input_ids` (on the
        device) replaces the batch's token ids: tokens a previous step sampled, not yet read."""
        inputs = build_inputs(batch, self.block_size, self.device)
        if input_ids is not None:
            inputs.input_ids = input_ids
        graphs = self.graphs
        usable = graphs is not None and tuple(aux_layers) == graphs.aux_layers
        key = graphs.can_run(inputs) if usable else None
        if self.tp_sender is not None:  # run() and launch() take logits iff a row samples
            rows = inputs.logits_indices if any(s.sample for s in batch.seqs) else None
            graph = None if key is None else (TARGET_GRAPH, key.mode, key.batch, key.tokens_per_seq)
            self.tp_sender.forward(inputs.input_ids, inputs.positions, inputs.attn, rows, graph)
        if self.token_pool is not None:
            write_tokens_no_sync(self.token_pool, inputs.attn.slot_mapping, inputs.input_ids)
        if key is not None:
            hidden, aux = graphs.replay(key, inputs)
            return hidden, ([] if aux is None else [aux]), inputs
        self.backend.prepare(inputs.attn)
        with forward_context(ForwardContext(inputs.attn, self.backend)):
            hidden, aux = self.model(inputs.input_ids, inputs.positions, aux_layers)
        return hidden, aux, inputs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        hidden, aux, inputs = self.forward(batch, self.aux_layers)
        aux_hidden = torch.cat(aux, dim=-1) if aux else None
        sampling = [s for s in batch.seqs if s.sample]
        if not sampling:
            return StepOutput(request_ids=[], token_ids=[], aux_hidden=aux_hidden)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [rows, vocab]
        batch.ready_masks()  # on the host while the device runs the forward
        if any(s.token_masks is not None for s in sampling):  # structured outputs: refused
            rows = [1 + (s.drafts.num_nodes if s.drafts else 0) for s in sampling]  # tokens
            masks = token_bitmask(sampling, rows)  # are never sampled nor verified
            # pinned: a pageable copy would wait here for the forward
            apply_token_bitmask_(logits, to_device_no_sync(masks, torch.int32, logits.device))
        ids = [s.request.request_id for s in sampling]
        if batch.mode != ForwardMode.VERIFY and not any(s.drafts for s in sampling):
            out = self.sampler(logits, sampling)
            logprobs = None if out.logprobs is None else [[lp or {}] for lp in out.logprobs]
            step = StepOutput(
                ids, [[t] for t in out.token_ids], logprobs=logprobs, aux_hidden=aux_hidden
            )
            picked, rows = _picked_rows(logits, sampling)
            if picked:  # their grammar decides among their top logits (Grammars.paths)
                step.grammar_logits = rows
                step.grammar_candidates = top_candidates(rows, picked)
            return step
        if any(s.grammar_topk for s in sampling):
            raise ValueError("grammar_topk rows are for plain decode steps: give them masks")
        tokens, accepted, logprobs = sample_and_verify(self.sampler, logits, sampling)
        src, dst = tree_kv_slots(sampling, accepted, self.block_size)
        if src:  # trees verified here: accepted nodes' KV into path order
            self._move_kv(src, dst)
        return StepOutput(
            ids, tokens, logprobs=logprobs, num_accepted=[len(n) for n in accepted],
            accepted_nodes=accepted, aux_hidden=aux_hidden,
        )  # fmt: skip

    def run_spec(self, batch: ScheduledBatch, k: int, k_draft: int) -> StepOutput:
        """A decode-phase batch through the speculative step (set_speculation): verify up to k
        drafts a sequence, accept, draft k_draft next ones, one host read (SpecStep.run)."""
        return self.spec_step.run(batch, k, k_draft)

    @torch.inference_mode()
    def profile_steps(
        self, ks: Sequence[int], batch_sizes: Sequence[int] | None = None, reps: int | None = None
    ) -> dict[int, dict[int, float]]:
        """Milliseconds of one step as the engine runs it at each batch size and k (0: plain
        decode): executor/step_timing.py."""
        return step_timing.profile_steps(self, ks, batch_sizes, reps)[0]

    def profile_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes profile_steps times when given none."""
        return step_timing.default_batch_sizes(self)

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None, candidates: bool = True
    ) -> tuple[torch.Tensor, LaunchedGrammar | None, torch.Tensor | None]:
        """A DECODE step, or prompt chunks (a speculative step run ahead's beside), without
        waiting for it: forward, logits and sampling are queued on the device and the sampled
        ids [sampling rows] returned there (read them with .tolist() later). Plain rows only:
        no drafts, no logprobs (engine/overlap.py decides). The aux streams of a
        drafter are made as in `run` and come back third (a copy, as `run`'s aux_hidden: the
        next replay leaves it alone), for the drafter to defer its rows from. Greedy
        constrained rows (grammar_topk) sample their unmasked argmax; their logits and top
        candidates come back beside, for their grammar to pick from once read (candidates
        False: their logits alone, for the engine's masked argmax on the device)."""
        hidden, aux, inputs = self.forward(batch, self.aux_layers, input_ids=input_ids)
        aux_hidden = torch.cat(aux, dim=-1) if aux else None
        sampling = [s for s in batch.seqs if s.sample]  # (a prompt chunk samples nothing)
        if not sampling:
            return torch.zeros(0, dtype=torch.int64, device=hidden.device), None, aux_hidden
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        ids = self.sampler.sample_no_sync(logits, sampling)
        picked, rows = _picked_rows(logits, sampling)
        if not picked:
            return ids, None, aux_hidden
        top = top_candidates_no_sync(rows) if candidates else None
        return ids, LaunchedGrammar(picked, rows, top), aux_hidden

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        """KV slot moves in this rank's pool and, under tensor parallelism, every rank's."""
        src_t = to_device_no_sync(src, torch.int64, self.device)
        dst_t = to_device_no_sync(dst, torch.int64, self.device)
        if self.tp_sender is not None:
            self.tp_sender.move_kv(src_t, dst_t)
        self.kv_pool.move_no_sync(src_t, dst_t)


def _picked_rows(
    logits: torch.Tensor, sampling: list[ScheduledSeq]
) -> tuple[list[int], torch.Tensor]:
    """The sampling rows whose grammar picks their token from their top logits
    (ScheduledSeq.grammar_topk), and those rows' logits: all of them as they are where every
    row picks, else gathered by an index sent pinned (a pageable copy waits for the device)."""
    picked = [i for i, s in enumerate(sampling) if s.grammar_topk]
    if not picked or len(picked) == len(sampling):
        return picked, logits
    return picked, logits.index_select(0, to_device_no_sync(picked, torch.int64, logits.device))


def _max_model_len(requested: int | None, cfg) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < limit:
        # Sliding-window attention is not implemented: beyond the window we would attend to
        # tokens the model never saw together, so the context stops there.
        limit = cfg.sliding_window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context of {limit} tokens: use <= {limit}"
        )
    return requested
