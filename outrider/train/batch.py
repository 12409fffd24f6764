"""One TTT micro-batch: packed rows of samples (dataset.py) + the target's features for them
(capture.py, or the disk cache) -> a TTTBatch on the training device. Used by the trainer and
by evaluation, so both score the draft on identically built batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.speculative.eagle3_vocab import draft_target_ids
from outrider.train.capture import FeatureCache, TargetCapture
from outrider.train.dataset import Sample, layout_batch
from outrider.train.ttt import TTTBatch


@dataclass
class DraftVocabMaps:
    """The draft vocabulary as the batch builder needs it, on the device."""

    draft_ids: torch.Tensor  # [Vd] target id of each draft id
    to_draft: torch.Tensor  # [vocab] draft id of each target id, -1 outside

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int, device: torch.device) -> DraftVocabMaps:
        ids = draft_target_ids(d2t.cpu())
        to_draft = torch.full((vocab_size,), -1, dtype=torch.int64)
        to_draft[ids] = torch.arange(ids.numel())
        return cls(ids.to(device), to_draft.to(device))


def build_batch(
    capture: TargetCapture,
    samples: list[Sample],
    rows: list[list[int]],  # sample indices per row
    max_len: int,
    vocab: DraftVocabMaps,
    cache: FeatureCache | None = None,
) -> TTTBatch:
    lay = layout_batch(samples, rows, max_len)
    sids = [samples[i].id for row in rows for i in row]
    if cache is not None and all(s in cache for s in sids):
        feats = cache.get(sids, capture.device, capture.dtype)
    else:
        feats = capture.features(lay.seqs)
        if cache is not None:
            cache.put(sids, [len(s) for s in lay.seqs], feats)
    p, top = capture.distributions(feats.final, vocab.draft_ids, vocab.to_draft)
    b, t = lay.input_ids.shape
    dest = lay.dest.to(capture.device)

    def packed(x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[N, ...] captured rows -> [B, T, ...] at their packed places (one scatter)."""
        out = x.new_full((b * t, *x.shape[1:]), fill)
        out[dest] = x
        return out.view(b, t, *x.shape[1:])

    ids = lay.input_ids.to(capture.device)
    return TTTBatch(
        input_ids=ids,
        positions=lay.positions.to(capture.device),
        seq_ids=lay.seq_ids.to(capture.device),
        loss_mask=lay.loss_mask.to(capture.device),
        hidden=packed(feats.aux),
        embeds=capture.embed(ids.view(-1)).view(b, t, -1),
        target_p=packed(p),
        target_top=packed(top, -1),
    )
