"""N-gram lookup on the device: ngram.py's drafts (the longest suffix of min_n..max_n tokens
that occurred before, its most recent occurrence, the tokens that followed it) from a window of
each row's last tokens, in a fixed number of tensor ops and no host read. The speculative step
runs it right after a verify (executor/token_drafts.py), so a step launched before the one
before it is read (engine/overlap.py) verifies a chain its predecessor drafted on the device,
as an EAGLE-3 drafter's does; the host lookup needs the tokens on the host, which a step run
ahead does not have.

One pass for every n: for each candidate end e of an earlier occurrence (a window position
with a follower, e <= W - 1 of a window of W + 1 tokens whose last is the sequence's last),
the match length m(e) is how many of the tokens ending at e equal those ending at W, counted
back from e and capped at max_n. The best e has the largest min(m, max_n) >= min_n, the latest
among equals: one argmax of m * (W + 1) + e.

    window   a  b  c  a  b  d  a  b        W + 1 = 8, min_n 1, max_n 2, k 4
    e        0  1  2  3  4  5  6  (7 is the suffix's end: no follower)
    m(e)     0  2  0  0  2  0  0      e = 4 (the latest of the two with m = 2)
    drafts   window[5 + (j mod 3)] = d a b d      (host: d a b, cut at the sequence's end)

Past the sequence's end the drafts repeat the period from the occurrence to the end (its
continuation, were the pattern to go on) where the host's are cut short: the step verifies k
drafts a row whatever it is given. A row with no occurrence drafts its last token k times.
Drafts change nothing but acceptance: the verify keeps only what the target computes.

Cost: one launch on a GPU (layers/fused.py's ngram_drafts, a program a row); elsewhere about
4 * max_n + 12 torch ops over [B, W + 1] int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outrider.layers import fused


def ngram_drafts_no_sync(
    window: torch.Tensor,  # [B, W + 1] int64: each row's last W + 1 tokens, its last one last
    valid: torch.Tensor,  # [B, W + 1] bool: False before the row's first token
    min_n: int,
    max_n: int,
    k: int,
) -> torch.Tensor:  # [B, k] int64
    """Each row's k drafts: the tokens after the most recent earlier occurrence of its
    longest suffix of min_n..max_n tokens (the module doc draws it)."""
    fused_out = fused.ngram_drafts(window, valid, min_n, max_n, k)
    if fused_out is not None:  # one launch on the GPU
        return fused_out
    b, width = window.shape
    last = width - 1
    if last < 1 or k < 1:
        return window[:, last:].expand(b, max(k, 0)).clone()
    # m(e) over candidate ends e = 0 .. last - 1, compared i tokens back from e and from last.
    run = torch.ones(b, last, dtype=torch.bool, device=window.device)
    match = torch.zeros(b, last, dtype=torch.int64, device=window.device)
    for i in range(max_n):
        if i >= last:
            break
        earlier = window[:, : last - i]  # the token i back from each e >= i
        ok = valid[:, : last - i] & valid[:, last - i : last - i + 1]
        same = (earlier == window[:, last - i : last - i + 1]) & ok
        run &= F.pad(same, (i, 0), value=False)  # e < i has nothing i back
        match += run
    e = torch.arange(last, device=window.device)
    score = torch.where(match >= min_n, match * width + e, -1)
    best, end = score.max(dim=1)  # [B]
    period = (last - end).clamp(min=1)  # from the occurrence's follower to the last token
    idx = end[:, None] + 1 + torch.arange(k, device=window.device)[None, :] % period[:, None]
    drafts = window.gather(1, idx.clamp(max=last))
    return torch.where(best[:, None] >= 0, drafts, window[:, last:])
