"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks: rank r
holds rows [r * V / tp, (r + 1) * V / tp). The embedding looks up the ids in its shard and
all-reduces (every other rank contributes zeros); the LM head all-gathers its logits so every
rank holds the whole vocabulary's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from outrider.distributed import TPGroup, single
from outrider.layers import batch_invariant, cpu_gemm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or single()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        if vocab_size % self.tp_size:
            raise ValueError(
                f"vocab size {vocab_size} does not split over tensor-parallel size "
                f"{self.tp_size}: pick a tensor-parallel size that divides {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.shard = vocab_size // self.tp_size
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] < self.vocab_size:  # some checkpoints store fewer rows than vocab_size
            raise ValueError(
                f"embedding has {loaded.shape[0]} rows but the config says vocab_size={self.vocab_size}"
            )
        param.data.copy_(loaded.narrow(0, self.start, self.shard))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)  # [N, hidden]: each id's row came from one rank


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary on every rank (each computes its shard's, then they are
    gathered); `tie(embedding)` shares the embedding weight (sharded alike)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup | None = None) -> None:
        super().__init__(vocab_size, hidden, tp)
        self.gemm = cpu_gemm.linear  # or the deterministic mode's row-invariant GEMM

    def use_batch_invariant(self) -> None:
        """Each row's logits summed in an order independent of the batch (deterministic mode)."""
        self.gemm = batch_invariant.linear

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gemm(hidden, self.weight)  # [N, vocab / tp]
        return self.tp.all_gather(logits, dim=-1)  # [N, vocab]
