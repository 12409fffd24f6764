"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if vocab_size % tp_size:
            raise ValueError(
                f"vocab size {vocab_size} does not split over tensor-parallel size {tp_size}"
            )
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.shard = vocab_size // tp_size
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] < self.vocab_size:  # some checkpoints store fewer rows than vocab_size
            raise ValueError(
                f"embedding has {loaded.shape[0]} rows but the config says vocab_size={self.vocab_size}"
            )
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.shard, self.shard))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        raise NotImplementedError("vocab-parallel embedding lookup needs the all-reduce wrapper")


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary shard; `tie(embedding)` shares the embedding weight."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [N, vocab_shard]
