"""A device drafter that pays for a real draft network but drafts synthetic tokens.

`SyntheticDrafter` wraps an `Eagle3Drafter` (any weights: random ones of the target's shape
serve, since time does not depend on values) and a `testing.synthetic.SyntheticProposer`.
Inside the speculative step the drafter runs exactly as it serves (the catch-up over the
verify's rows and the k - 1 chain steps, in the draft graph), and its drafts are dropped: the
step hands back an empty [B, 0] tensor, so the engine finds no device drafts and asks `propose`,
which returns the synthetic proposer's drafts for the next verify. After prefill steps the
drafter still extends over the prompt (`observe`), as it does in serving.

What this costs beside a real drafter: the host drafts each request's chain in Python (a few
microseconds a request) where the real drafter's drafts come back in the step's one read; the
step's device work, its graphs and its one host read are those of the real drafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.core import Request, ScheduledBatch, SeqDrafts, StepOutput
from outrider.executor.drafter import Eagle3Drafter
from outrider.layers.forward_context import AttentionMetadata
from outrider.models.eagle3 import Eagle3Draft
from outrider.testing.synthetic import SyntheticProposer


class SyntheticDrafter:
    """Satisfies `outrider.speculative.base.DeviceDrafter` (chains only)."""

    on_device = True
    writes_kv = True  # the wrapped drafter's chain steps write draft KV
    topk = 1
    num_steps = None

    def __init__(self, drafter: Eagle3Drafter, proposer: SyntheticProposer) -> None:
        if drafter.topk != 1:
            raise ValueError(
                f"SyntheticDrafter drafts chains; the drafter has topk={drafter.topk}: build it "
                "with topk=1"
            )
        self.drafter = drafter
        self.use_proposer(proposer)
        self.aux_layers = drafter.aux_layers

    def use_proposer(self, proposer: SyntheticProposer) -> None:
        """Draft from `proposer` from now on: a benchmark measures several curves on one engine
        without recapturing its graphs, which hold the wrapped drafter, not the proposer."""
        self.proposer = proposer
        self.name = f"{proposer.name}+{self.drafter.name}"

    # -- what the wrapped drafter is --------------------------------------------------------

    @property
    def draft(self) -> Eagle3Draft:
        return self.drafter.draft

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    @property
    def sharded(self) -> bool:
        return self.drafter.sharded

    # -- the proposal calls: the synthetic drafts, the drafter following the target ---------

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        return self.proposer.propose(requests, max_draft_tokens)

    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        self.drafter.observe(batch, output)

    def defer(self, batch: ScheduledBatch, output: StepOutput) -> None:
        self.drafter.defer(batch, output)

    def catch_up(self) -> None:
        self.drafter.catch_up()

    def forget(self, request_id: str) -> None:
        self.drafter.forget(request_id)
        self.proposer.forget(request_id)

    def positions_needed(self, k: int) -> int:
        return self.drafter.positions_needed(k)

    # -- on the device: the drafter's whole cost --------------------------------------------

    def after_verify_no_sync(self, *args, **kwargs) -> torch.Tensor:  # [B, 0]
        """The drafter's whole forward runs (and is captured in the draft graph); its drafts
        are not returned, so the synthetic ones take their place."""
        return self.drafter.after_verify_no_sync(*args, **kwargs)[:, :0]

    def tree_after_verify_no_sync(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("SyntheticDrafter drafts chains, not trees")

    def run_rows(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        aux_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.run_rows(ids, positions, meta, hidden, rows, aux_rows)
