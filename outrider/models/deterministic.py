"""The deterministic mode for a built model, target or drafter (ModelConfig.deterministic):
every layer with a batch-dependent reduction switched to its batch-invariant form
(layers/batch_invariant.py), or the model refused as a whole."""

from __future__ import annotations

from torch import nn

from outrider.layers.attention import LatentAttention
from outrider.layers.embedding import ParallelLMHead
from outrider.layers.linear import _Linear
from outrider.layers.moe import FusedExperts, GroupedTopkRouter
from outrider.layers.norm import RMSNorm

# Layers with no batch-invariant form yet: the MoE router and grouped GEMM tile by expert
# groups the batch decides, MLA attention splits its context by the batch.
_UNSUPPORTED = (FusedExperts, GroupedTopkRouter, LatentAttention)


def make_batch_invariant(model: nn.Module) -> None:
    """Switch every linear, LM head and RMSNorm of `model` to its batch-invariant form. A layer
    with no such form yet (MoE experts and router, MLA attention) is refused by name, so a
    model is deterministic as a whole or not at all."""
    for name, module in model.named_modules():
        if isinstance(module, _UNSUPPORTED):
            raise ValueError(
                f"deterministic=True: {type(module).__name__} ({name}) has no batch-invariant "
                f"kernel yet (the MoE grouped GEMM and MLA attention follow the dense layers); "
                f"serve this model with deterministic=False"
            )
    for module in model.modules():
        if isinstance(module, (_Linear, ParallelLMHead, RMSNorm)):
            module.use_batch_invariant()
