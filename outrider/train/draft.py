"""A fresh, trainable EAGLE-3 drafter for a target: the serving module (models/eagle3.py) with
random weights and autograd switched on (outrider's layers create frozen parameters)."""

from __future__ import annotations

import dataclasses

import torch

from outrider.loaders.hf_config import ModelConfig
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft


def new_draft(
    target: ModelConfig,
    d2t: torch.Tensor,  # [Vd] int64 offsets: target id = i + d2t[i]
    t2d: torch.Tensor,  # [vocab] bool
    *,
    max_positions: int,
    std: float = 0.02,
    seed: int = 0,
    device: torch.device | str = "cpu",
    intermediate_size: int | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> Eagle3Draft:
    """Eagle3Config.for_target(target, len(d2t)) (with this MLP `intermediate_size` and these
    `aux_layers` if given), weights ~ N(0, std) from `seed`, norms at 1, fp32 master weights,
    every parameter requires_grad."""
    if d2t.dim() != 1 or t2d.shape != (target.vocab_size,):
        raise ValueError(
            f"draft vocabulary maps of shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do "
            f"not fit a target vocabulary of {target.vocab_size}: rebuild them for this target"
        )
    cfg = Eagle3Config.for_target(target, int(d2t.numel()))
    if intermediate_size is not None:
        cfg = dataclasses.replace(cfg, intermediate_size=intermediate_size)
    if aux_layers is not None:
        cfg = dataclasses.replace(cfg, aux_layers=tuple(aux_layers))
    with torch.device(device):
        draft = Eagle3Draft(cfg, max_positions=max_positions).float()
    init_weights(draft, std, seed)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


def init_weights(draft: Eagle3Draft, std: float = 0.02, seed: int = 0) -> None:
    """Deterministic init, the same on every rank (the generator is local, on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(draft.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            p.requires_grad_(True)


def head_from_target(draft: Eagle3Draft, target: torch.nn.Module) -> None:
    """Start the draft's output head as the target's: `lm_head` rows of the draft vocabulary
    (target id = i + d2t[i]) and the final norm's weight, so the draft has only to approach
    the target's last hidden state, not also learn to read out tokens from it."""
    ids = torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t
    head, norm = target.lm_head.weight, target.model.norm.weight
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[ids.to(head.device)].float())
        draft.norm.weight.copy_(norm.float())
