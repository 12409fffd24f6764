"""The proposer protocols: `Proposer`, what the engine asks of every drafter, and
`DeviceDrafter`, what the speculative step asks besides of a drafter that drafts inside it. What
a proposer hands the engine, draft tokens per sequence as a chain or a tree (`SeqDrafts`), is
plain data in outrider/core.py, drawn there; it is re-exported here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from outrider.core import Request, ScheduledBatch, SeqDrafts, StepOutput

if TYPE_CHECKING:
    import torch

    from outrider.layers.attn_backends.base import AttentionBackend
    from outrider.layers.forward_context import AttentionMetadata
    from outrider.models.eagle3 import Eagle3Draft
    from outrider.speculative.tree_batch import TreeShape

__all__ = ["DeviceDrafter", "Proposer", "SeqDrafts", "TokenDrafter"]


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for running requests. Implementations are registered by name in
    `outrider.engine.proposers`; a new drafter adds a file, not branches.

    Two kinds, told apart by `on_device`:
    - host proposers (n-gram) draft in `propose` before a step, from the requests' tokens;
    - device drafters (EAGLE-3, a network the runner owns; `DeviceDrafter` below) draft inside
      the speculative step right after verifying (their next drafts come back in
      StepOutput.next_drafts); `propose` serves the steps that are not speculative steps
      (prefill, trees).

    Invariant: `propose` returns one entry per request, in order; an entry may be empty (no
    drafts this step), and its length never exceeds `max_draft_tokens`.
    """

    name: str
    on_device: bool  # drafts inside the speculative step (needs the target's aux streams)
    aux_layers: tuple[int, ...]  # target layers whose input streams it reads; () for none
    writes_kv: bool  # writes its own KV in the slots past a request's computed tokens
    topk: int  # 1 drafts chains; > 1 trees (a host proposer's verified per sequence)

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]: ...

    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Called after every step's postprocess with what the target just computed (drafters
        that follow the target's features catch up here; others do nothing)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop per-request state; the engine calls it when a request finishes or aborts."""
        ...

    def positions_needed(self, k: int) -> int:
        """Slots from a request's root position that proposing k drafts and verifying them
        use (1 + k for drafts that write no KV)."""
        ...


@runtime_checkable
class DeviceDrafter(Proposer, Protocol):
    """A proposer with `on_device` True: a draft network the runner owns, run inside the
    speculative step right after each verify (executor/spec_step.py), eagerly for the steps
    that step does not take (`observe`, `propose`; trees through speculative/eagle3_tree.py),
    and under tensor parallelism by every rank's copy alike (executor/tp_draft.py).

    Invariants: the `*_no_sync` calls read nothing on the host, so a CUDA graph can capture
    them; drafts are target token ids; draft KV goes only to slots the scheduler reserved past
    a row's computed tokens (`positions_needed`, or the step's lookahead) or, past the end of
    a row's table, to the scratch block (the block tables' last column); a `sharded` drafter
    runs every forward on every rank, in the order rank 0 runs them, and never in a graph.
    """

    draft: Eagle3Draft  # the network: its config's vocabularies, to_target_ids
    device: torch.device
    block_size: int  # the target's: draft KV shares its block ids
    sharded: bool  # split over the target's ranks (draft_tensor_parallel_size > 1)
    num_steps: int | None  # tree depth when topk > 1 (None: min(k, DEFAULT_MAX_STEPS))

    def after_verify_no_sync(
        self,
        meta: AttentionMetadata,  # the verify's: [B, t] rows, t = 1 + k
        next_ids: torch.Tensor,  # [B * t] the target's token after each row
        positions: torch.Tensor,  # [B * t]
        aux: torch.Tensor,  # [B * t, n_aux * Ht] the target's aux streams at each row
        num_accepted: torch.Tensor,  # [B]
        starts: torch.Tensor,  # [B] each row's root position
        block_tables: torch.Tensor,  # [B, W] int32, padded with the scratch block
        k_draft: int,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [B, k_draft] int64 next drafts (a width of 0: none, ask `propose`)
        """A chain step's drafting: catch up over the verify's rows, then draft the next chain
        from the row after each sequence's last accepted one."""
        ...

    def tree_after_verify_no_sync(
        self,
        path_ids: torch.Tensor,  # [B, 1 + S] the target's tokens along the accepted path
        path_aux: torch.Tensor,  # [B * (1 + S), n_aux * Ht] the aux streams there
        num_accepted: torch.Tensor,  # [B]
        starts: torch.Tensor,  # [B] each row's root position
        block_tables: torch.Tensor,  # [B, W] int32; its last column is the scratch block
        shape: TreeShape,
        backend: AttentionBackend,
        path_rows: torch.Tensor | None = None,  # [B, 1 + S] verify rows of the path (sharded)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # next tree: tokens [B, N], parents [B, N]
        """A tree step's drafting: catch up over the accepted path, then grow the next tree."""
        ...

    def defer(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """After a plain step while speculation is off: keep the rows it made valid, to extend
        over at the next `catch_up` instead of now."""
        ...

    def catch_up(self) -> None:
        """Extend over the rows `defer` kept (one forward): before anything reads the draft KV.
        `observe` and `propose` call it themselves; the engine calls it before a step."""
        ...

    def run_rows(
        self,
        ids: torch.Tensor,  # [T] each row's next token
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        hidden: torch.Tensor,  # [T, n_aux * Ht] target aux streams, or [T, H] the draft's own
        rows: torch.Tensor,  # [R] the rows to read logits at
        aux_rows: torch.Tensor | None = None,  # [T]: hidden is these rows of the last aux
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [R, draft_vocab], pre-norm hidden [R, H]
        """One eager draft forward (a sharded drafter's other ranks run it alongside)."""
        ...


@runtime_checkable
class TokenDrafter(Protocol):
    """A host proposer of chains (n-gram lookup) that also drafts inside the speculative step,
    on the device, from each row's last tokens alone, where steps run ahead of their read
    (engine/overlap.py): there the host does not have the tokens a step's successor drafts
    from. The runner keeps every target forward's input tokens beside the KV and hands it a
    window of them after each verify (executor/token_drafts.py); `propose` still drafts for
    rows the step did not (a request just admitted, speculation just turned on).

    Invariants: `draft_from_tokens_no_sync` reads nothing on the host, so a CUDA graph can
    capture it; it returns k target token ids a row (a row with nothing to draft from repeats
    a token: drafts change acceptance, never output).
    """

    token_window: int  # tokens before each row's last that a lookup reads; 0: host only

    def draft_from_tokens_no_sync(
        self,
        tokens: torch.Tensor,  # [B, token_window + 1] int64: each row's last tokens, last last
        valid: torch.Tensor,  # [B, token_window + 1] bool: False before a row's first token
        k: int,
    ) -> torch.Tensor:  # [B, k] int64
        """Each row's next k drafts."""
        ...
