r"""Trees for a whole batch at a fixed shape: what the speculative step needs to verify, accept
and grow draft trees on the device, inside a CUDA graph (no host reads, no per-row Python).

Every row has N node slots; a row's real nodes come first (num_nodes of them), the rest are
padding that can never be accepted. Parents index the row's nodes (-1 = the root), in
topological order as in tree.py.

Worked example, one row, parents [-1, -1, 0, 1], tokens [a, b, c, d], root r:

             r                 verify rows: 0 = r, 1 = a, 2 = b, 3 = c, 4 = d
           /   \               argmax at rows [a, c, y, z, w]: a follows r, c follows a
          a     b              matched nodes: a (its parent's row 0 says a), c (row 1 says c)
          |     |              accepted path: a, c (depth 2), so num_accepted 2
          c     d              path_rows [0, 1, 3]: r, a, c; tokens out = argmax there
                               = [a, c, z]: the accepted drafts, then the target's own token
    KV: the verify wrote node i at root + 1 + i: c (node 2) sits at root + 3 and moves to root + 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def ancestors_np(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """parents [B, N] -> (anc [B, 1 + N, 1 + N] bool, depth [B, N] int64).

    anc[b, q, j]: row q (0 = root, 1 + i = node i) may attend row j: j is q or an ancestor of q
    (the verify's tree mask over its own rows). depth: 1 for the root's children. One NumPy op
    per node over the whole batch (topological order: a parent's row is done before its
    children's)."""
    b, n = parents.shape
    anc = np.zeros((b, 1 + n, 1 + n), dtype=bool)
    anc[:, 0, 0] = True
    depth = np.zeros((b, 1 + n), dtype=np.int64)
    rows = np.arange(b)
    for i in range(n):
        p = parents[:, i] + 1  # the parent's row (0: the root)
        anc[:, 1 + i] = anc[rows, p]
        anc[:, 1 + i, 1 + i] = True
        depth[:, 1 + i] = depth[rows, p] + 1
    return anc, depth[:, 1:]


def ancestors_no_sync(
    parents: torch.Tensor,  # [B, N] int64, -1 = the root
    max_depth: int,  # no node is deeper (a tree grown over S steps: S)
) -> tuple[torch.Tensor, torch.Tensor]:
    """ancestors_np on the device, graph-safe: (anc [B, 1 + N, 1 + N] bool, depth [B, N]).

    Row q starts seeing itself and its parent; squaring that relation (a batched matmul of
    0/1 matrices, exact in float32) doubles the generations it covers, so ceil(log2(max_depth))
    squarings reach the root from any node. Depth is the count of ancestors, root included,
    minus one."""
    b, n = parents.shape
    dev = parents.device
    par = torch.cat([torch.zeros(b, 1, dtype=parents.dtype, device=dev), parents + 1], dim=1)
    rows = torch.arange(1 + n, device=dev)
    rel = (rows[None, None, :] == par[:, :, None]) | (rows[:, None] == rows[None, :])[None]
    rel = rel.float()
    for _ in range(max(1, max_depth - 1).bit_length()):
        rel = torch.bmm(rel, rel).clamp_(max=1.0)
    anc = rel > 0
    return anc, anc.sum(dim=-1)[:, 1:] - 1


def accept_tree_greedy_no_sync(
    argmax: torch.Tensor,  # [B, 1 + N] the target's argmax at each verify row
    drafts: torch.Tensor,  # [B, N] node tokens
    parents: torch.Tensor,  # [B, N] int64, -1 = the root
    anc: torch.Tensor,  # [B, 1 + N, 1 + N] bool, ancestors_np's
    depth: torch.Tensor,  # [B, N] int64
    num_nodes: torch.Tensor,  # [B] real nodes per row
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (path_rows [B, 1 + max_depth] int64, num_accepted [B] int64).

    A node matches when its token is the argmax at its parent's row; it is accepted when it and
    all its ancestors match. The deepest accepted node ends the path (siblings carry distinct
    tokens, so at most one node per depth is accepted). path_rows[:, d] is the verify row of
    the path's node at depth d (0: the root) for d <= num_accepted; past that it repeats the
    last one. Graph-safe: fixed shapes, no host reads."""
    b, n = drafts.shape
    dev = drafts.device
    real = torch.arange(n, device=dev)[None, :] < num_nodes[:, None]
    match = (drafts == argmax.gather(1, parents + 1)) & real  # [B, N]
    ok_rows = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), match], dim=1)
    accepted = ~(anc & ~ok_rows[:, None, :]).any(dim=-1)  # [B, 1 + N]: every ancestor matched
    depth_rows = torch.cat([torch.zeros(b, 1, dtype=depth.dtype, device=dev), depth], dim=1)
    score = torch.where(accepted, depth_rows, -1)
    best = score.argmax(dim=1)  # the root (depth 0) always qualifies
    num_accepted = depth_rows.gather(1, best[:, None]).squeeze(1)
    on_path = anc.gather(1, best[:, None, None].expand(-1, 1, 1 + n)).squeeze(1)  # [B, 1 + N]
    levels = torch.arange(1 + max_depth, device=dev)
    at = on_path[:, None, :] & (depth_rows[:, None, :] == levels[None, :, None])
    path_rows = at.float().argmax(dim=-1)  # [B, 1 + D]; 0 where no node (past the end)
    last = path_rows.gather(1, num_accepted[:, None])
    path_rows = torch.where(levels[None, :] <= num_accepted[:, None], path_rows, last)
    return path_rows, num_accepted


def tree_kv_moves_no_sync(
    path_rows: torch.Tensor,  # [B, 1 + D]
    num_accepted: torch.Tensor,  # [B]
    starts: torch.Tensor,  # [B] root positions
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (src_pos, dst_pos) [B, D]: the accepted node at depth d moves from the slot the verify
    wrote it to (root + its row) to root + d, where plain decoding puts it. Past num_accepted,
    and where the node is already in place, src == dst (a copy onto itself). Gathering every
    source before scattering is safe: a destination root + d never holds a source of a deeper
    node (its row is >= its depth)."""
    d = path_rows.shape[1] - 1
    levels = torch.arange(1, d + 1, device=path_rows.device)[None, :]
    dst = starts[:, None] + levels
    src = starts[:, None] + path_rows[:, 1:]
    src = torch.where(levels <= num_accepted[:, None], src, dst)
    return src, dst


def select_tree_no_sync(
    tokens: torch.Tensor,  # [B, S, t] candidate tokens per depth (S depths, t per depth)
    scores: torch.Tensor,  # [B, S, t] cumulative draft log-probabilities
    parents: torch.Tensor,  # [B, S, t] int64: index of the parent among the previous depth's t
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best num_nodes candidates per row as a tree -> (tokens [B, n], parents [B, n]) in
    topological order (by depth, then index), parents indexing the kept nodes (-1: the root).

    A child's score never exceeds its parent's (log-probabilities are <= 0) and a stable sort
    over (depth, index) order puts ties shallower first, so a kept node's parent is kept too."""
    b, s, t = tokens.shape
    dev = tokens.device
    flat_scores = scores.reshape(b, s * t)
    order = torch.sort(flat_scores, dim=1, descending=True, stable=True).indices
    keep = order[:, :num_nodes].sort(dim=1).values  # [B, n] flat (depth * t + index)
    # The parent's flat index; depth 0's parents (-1) come out negative: the root.
    depth = torch.arange(s, device=dev).repeat_interleave(t)[None, :]
    flat_parent = parents.reshape(b, s * t) + (depth - 1) * t
    where = torch.full((b, s * t), -1, dtype=torch.int64, device=dev)
    where.scatter_(1, keep, torch.arange(num_nodes, device=dev).expand(b, -1).contiguous())
    kept_parent = flat_parent.gather(1, keep)
    out_parents = torch.where(
        kept_parent >= 0, where.gather(1, kept_parent.clamp(min=0)), torch.full_like(keep, -1)
    )
    return tokens.reshape(b, s * t).gather(1, keep), out_parents


@dataclass(frozen=True)
class TreeShape:
    """A draft tree budget: num_nodes drafts verified per step, grown topk per depth over
    num_steps depths (EAGLE-2 style, speculative/eagle3_tree.py)."""

    num_nodes: int
    topk: int
    num_steps: int

    def __post_init__(self) -> None:
        if min(self.num_nodes, self.topk, self.num_steps) < 1:
            raise ValueError(f"a tree needs num_nodes, topk and num_steps >= 1, got {self}")
        if self.num_nodes > self.topk * self.num_steps:
            raise ValueError(
                f"num_nodes={self.num_nodes} exceeds the {self.topk * self.num_steps} candidates "
                f"that topk={self.topk} over num_steps={self.num_steps} grow: lower "
                "num_draft_tokens or raise topk / num_steps"
            )

    @property
    def reach(self) -> int:
        """Positions past a row's root that one step writes: the verify's N nodes, the drafter's
        extend over the root and S path rows, and the (S - 1) * topk frontier nodes it grows
        from the new root (root + num_accepted + 1 <= root + S + 1)."""
        return max(1 + self.num_nodes, 1 + self.num_steps + (self.num_steps - 1) * self.topk)
