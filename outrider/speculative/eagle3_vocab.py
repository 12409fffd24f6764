"""EAGLE-3's draft vocabulary: which target tokens the drafter's lm_head can propose.

    draft slot i  ->  target token i + d2t[i]          d2t: int64 [draft_vocab] (an offset,
                                                              as SGLang, vLLM and SpecForge store it)
    target token v is a draft token  <=>  t2d[v]       t2d: bool  [vocab]

Invariants of a sound mapping (SpecForge writes it this way and `build_draft_vocab` keeps it):
the target ids i + d2t[i] are strictly increasing (sorted, so no two slots share a token) and
lie in [0, vocab); t2d marks exactly those ids, so t2d.sum() == draft_vocab. Worked example,
vocab 6, draft 3, chosen tokens {1, 4, 5}: d2t = [1 - 0, 4 - 1, 5 - 2] = [1, 3, 3],
t2d = [F, T, F, F, T, T].
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def build_draft_vocab(
    token_counts: torch.Tensor,  # [vocab] int64, how often each target token was seen
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (d2t int64 [draft_vocab_size], t2d bool [vocab]) for the `draft_vocab_size` most
    frequent target tokens. Ties go to the lower id; unseen tokens fill the rest in id order,
    so the size is always exact. Slots are sorted by target id."""
    if token_counts.dim() != 1:
        raise ValueError(
            f"token_counts must be 1-D [vocab], got shape {tuple(token_counts.shape)}: count "
            f"with torch.bincount(ids, minlength=vocab_size)"
        )
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(
            f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab} (the target vocabulary)"
        )
    if token_counts.is_floating_point() or token_counts.is_complex():
        raise ValueError(f"token_counts must hold integer counts, got {token_counts.dtype}")
    counts = token_counts.detach().to("cpu", torch.int64)
    if bool((counts < 0).any()):  # CPU tensor: no device sync
        bad = int(torch.nonzero(counts < 0)[0])
        raise ValueError(f"token_counts[{bad}] = {int(counts[bad])} is negative")
    # A stable descending sort keeps equal counts in id order: ties -> lower id, and the
    # zero-count tail fills by id.
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = order[:draft_vocab_size].sort().values  # [draft] target ids, ascending
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[draft] offsets -> [draft] target ids (i + d2t[i])."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The membership mask a d2t implies (for drafters published without t2d)."""
    ids = draft_target_ids(d2t)
    _check_range(ids, vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[ids] = True
    return t2d


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> list[str]:
    """Every way (d2t, t2d) breaks the invariants in this module's docstring, as sentences
    that name the values; [] when the mapping is sound. CPU work on small tensors."""
    problems: list[str] = []
    if d2t.dim() != 1 or d2t.is_floating_point():
        return [f"d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}"]
    ids = draft_target_ids(d2t.cpu())
    n = ids.numel()
    out = (ids < 0) | (ids >= vocab_size)
    if bool(out.any()):
        i = int(torch.nonzero(out)[0])
        problems.append(
            f"{int(out.sum())} of {n} draft slots map outside the target vocabulary "
            f"[0, {vocab_size}), e.g. slot {i} -> {int(ids[i])}: d2t is for a larger vocabulary"
        )
    steps = ids[1:] - ids[:-1]
    if n > 1 and bool((steps <= 0).any()):
        i = int(torch.nonzero(steps <= 0)[0])
        problems.append(
            f"d2t is not strictly increasing in target id ({int((steps <= 0).sum())} of {n - 1} "
            f"steps go down or repeat, first at slot {i + 1}: {int(ids[i])} -> {int(ids[i + 1])}): "
            f"the mapping was shuffled or rebuilt, so lm_head rows no longer name their tokens"
        )
    if t2d is None:
        return problems
    if t2d.dim() != 1 or t2d.numel() != vocab_size:
        problems.append(f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},)")
        return problems
    t2d = t2d.cpu().to(torch.bool)
    marked = int(t2d.sum())
    in_range = ids[~out]
    unmarked = int((~t2d[in_range]).sum()) if in_range.numel() else 0
    if unmarked or marked != n:
        problems.append(
            f"t2d disagrees with d2t: t2d marks {marked} tokens for {n} draft slots and "
            f"{unmarked} slots map to tokens t2d leaves unmarked; rebuild t2d from d2t "
            f"(t2d_from_d2t) if d2t is right"
        )
    return problems


def resolve_draft_vocab(
    d2t: torch.Tensor | None,  # [draft] as stored, or None
    t2d: torch.Tensor | None,  # [vocab] as stored, or None
    vocab_size: int,
    draft_vocab_size: int,
    where: object = "the drafter",
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a loader keeps: (d2t int64, t2d bool). Published drafters may lack t2d (derived
    from d2t) or, with a full-size draft vocabulary, d2t (identity). Raises when the mapping
    leaves the target vocabulary; logs other breaks (the doctor explains them)."""
    if d2t is None:
        if draft_vocab_size != vocab_size:
            raise ValueError(
                f"{str(where)!r} has no d2t but draft_vocab_size={draft_vocab_size} < "
                f"vocab_size={vocab_size}: nothing says which target token each lm_head row is; "
                f"re-export the drafter with its d2t"
            )
        d2t = torch.zeros(draft_vocab_size, dtype=torch.int64)
    d2t = d2t.to(torch.int64)
    t2d = t2d_from_d2t(d2t, vocab_size) if t2d is None else t2d.to(torch.bool)
    if problems := check_draft_vocab(d2t, t2d, vocab_size):
        if any("outside the target vocabulary" in p for p in problems):
            raise ValueError(f"{str(where)!r}: {problems[0]}")
        log.warning("%s has a broken draft vocabulary: %s", where, "; ".join(problems))
    return d2t, t2d


def _check_range(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"d2t maps draft slots to target ids {int(ids.min())}..{int(ids.max())}, outside the "
            f"target vocabulary [0, {vocab_size}): the drafter was built for another vocabulary"
        )
