"""The requests of an EAGLE-3 proposal that sample: their drafts drawn from the draft's
distribution under each request's own sampling settings (executor/drafter.py's `propose`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.core import Request
from outrider.executor.sampler import SamplingRow, sample_from_probs_no_sync, sampling_probs
from outrider.speculative.base import DeviceDrafter
from outrider.transfer import to_device_no_sync


class SampledRows:
    """The requests of a proposal that sample (temperature > 0): their drafts are drawn from
    the draft's distribution under the request's own temperature / top-k / top-p / min-p,
    with the request's generator, and that distribution (over the target vocabulary) goes
    with the drafts, so rejection sampling accepts more and stays exact. Greedy requests keep
    the argmax and deterministic drafts."""

    def __init__(self, proposer: DeviceDrafter, reqs: Sequence[Request]) -> None:
        self.index = [i for i, r in enumerate(reqs) if not r.params.greedy]
        self.rows = [SamplingRow.of_request(reqs[i]) for i in self.index]
        self.draft = proposer.draft
        self.vocab = proposer.draft.config.vocab_size
        self.probs: list[torch.Tensor] = []  # per step: [S, vocab]
        if self.index:
            self.index_t = to_device_no_sync(self.index, torch.int64, proposer.device)
            vd = proposer.draft.config.draft_vocab_size
            self.target_ids = proposer.draft.to_target_ids(torch.arange(vd, device=proposer.device))

    def __bool__(self) -> bool:
        return bool(self.index)

    def draw(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """tokens [B] (argmax drafts), logits [B or S, draft_vocab] -> tokens with the sampled
        rows redrawn; remembers their distributions."""
        if logits.shape[0] != len(self.index):
            logits = logits.index_select(0, self.index_t)
        full = logits.new_full((len(self.index), self.vocab), float("-inf"), dtype=torch.float32)
        full[:, self.target_ids] = logits.float()
        probs = sampling_probs(full, self.rows)  # [S, vocab]
        self.probs.append(probs)
        drawn = sample_from_probs_no_sync(probs, [r.generator for r in self.rows])
        return tokens.index_copy(0, self.index_t, drawn)

    def per_request(self) -> dict[int, torch.Tensor]:
        """Batch row -> [k, vocab] distributions its k drafts were drawn from."""
        stacked = torch.stack(self.probs, dim=1)  # [S, k, vocab]
        return {b: stacked[j] for j, b in enumerate(self.index)}
