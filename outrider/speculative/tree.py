r"""Tree topology for verification: which draft node hangs under which, and what follows from
that for the verify forward (positions, attention mask) and for the KV cache after acceptance.

A chain of k drafts is the degenerate tree `parents = [-1, 0, ..., k - 2]`. Node indices are
in topological order (a parent before its children); parent -1 is the root, the sequence's
last accepted token, whose KV the verify forward computes together with the nodes.

Worked example, `parents = [-1, -1, 0, 0, 1]`, root token at position 10:

                 root (pos 10)
                /            \
          n0 (d 1)          n1 (d 1)
          /      \              \
     n2 (d 2)   n3 (d 2)       n4 (d 2)

    depths       [1, 1, 2, 2, 2]
    children(-1) [0, 1]     children(0) [2, 3]     children(1) [4]
    paths        [[0, 2], [0, 3], [1, 4]]
    positions(10) [10, 11, 11, 12, 12, 12]       (root, n0 .. n4: RoPE position = 10 + depth)

    ancestor_mask (row = query, column = key; 1 = may attend):
            R  n0 n1 n2 n3 n4
        R   1  .  .  .  .  .
        n0  1  1  .  .  .  .
        n1  1  .  1  .  .  .
        n2  1  1  .  1  .  .
        n3  1  1  .  .  1  .
        n4  1  .  1  .  .  1

Siblings share a position (n0 and n1 are both "the token after the root"); only the mask
keeps them from seeing each other. The verify forward writes KV in node order, though, so
after acceptance the accepted path is compacted (see `accepted_kv_moves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch


@dataclass(frozen=True)
class TreeTopology:
    """Draft tree shape. Invariant (checked on construction): -1 <= parents[i] < i."""

    parents: tuple[int, ...]  # node i's parent index, -1 = the root

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(
                    f"invalid tree: parents[{i}] = {p}, but a node's parent must be -1 (the "
                    f"root) or an earlier node in [0, {i}); list nodes in topological order "
                    f"(parents: {list(self.parents)})"
                )

    @classmethod
    def chain(cls, k: int) -> TreeTopology:
        if k < 0:
            raise ValueError(f"a chain needs k >= 0 draft tokens, got k={k}")
        return cls(tuple(range(-1, k - 1)))

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> TreeTopology:
        """Shared per shape: the engine rebuilds the same few shapes every step (inputs, verify,
        KV moves), so their depths and children are computed once."""
        return _cached(tuple(int(p) for p in parents)) if cls is TreeTopology else cls(parents)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for p in self.parents:  # a parent precedes its children, so its depth is known
            depths.append(1 if p < 0 else depths[p] + 1)
        return tuple(depths)

    @cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        kids: dict[int, list[int]] = {i: [] for i in range(-1, self.num_nodes)}
        for i, p in enumerate(self.parents):
            kids[p].append(i)
        return {i: tuple(c) for i, c in kids.items()}

    def children(self, i: int) -> list[int]:
        """Node i's children in node order; i = -1 gives the root's."""
        if not -1 <= i < self.num_nodes:
            raise ValueError(f"no node {i} in a tree of {self.num_nodes} nodes (use -1 .. n-1)")
        return list(self._children[i])

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def positions(self, root_pos: int) -> list[int]:
        """Positions of the verify forward's 1 + N query tokens (root first, then nodes)."""
        return [root_pos] + [root_pos + d for d in self.depths]

    def ancestor_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[1 + N, 1 + N] bool over (root, nodes): query q may attend key k iff k is q itself or
        an ancestor of q; the root is everyone's ancestor. Built row by row from the parent's
        row, which topological order has already finished."""
        n = 1 + self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, p in enumerate(self.parents):
            mask[1 + i] = mask[1 + p]  # row 1 + p is the parent's (row 0 for the root)
            mask[1 + i, 1 + i] = True
        return mask if device is None else mask.to(device)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (root excluded), leaves in node order. Empty tree: []."""
        out = []
        for leaf in range(self.num_nodes):
            if self._children[leaf]:
                continue
            path = [leaf]
            while self.parents[path[-1]] >= 0:
                path.append(self.parents[path[-1]])
            out.append(path[::-1])
        return out


@lru_cache(maxsize=1024)
def _cached(parents: tuple[int, ...]) -> TreeTopology:
    return TreeTopology(parents)


def verify_mask(
    topology: TreeTopology, prefix_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """One sequence's verify attention mask: [1 + N, prefix_len + 1 + N] bool. The prefix_len
    tokens before the root (KV already in the cache) are visible to every query; the last
    1 + N columns are `topology.ancestor_mask()`.

    Example, chain of 2 behind a 3-token prefix (P = prefix, R = root):
              P  P  P  R  n0 n1
        R     1  1  1  1  .  .
        n0    1  1  1  1  1  .
        n1    1  1  1  1  1  1
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    tree = topology.ancestor_mask()
    prefix = torch.ones(tree.shape[0], prefix_len, dtype=torch.bool)
    mask = torch.cat([prefix, tree], dim=1)
    return mask if device is None else mask.to(device)


def accepted_kv_moves(
    topology: TreeTopology, accepted_nodes: Sequence[int], root_slot_pos: int
) -> list[tuple[int, int]]:
    """(from_position, to_position) KV copies that compact an accepted path after a verify.

    The verify forward wrote the root's KV at root_slot_pos and node i's at
    root_slot_pos + 1 + i (node order); the accepted node at depth d must end at
    root_slot_pos + d, where plain decoding would have put it. Only moves with from != to are
    returned, so a chain (node i has depth i + 1) never needs any.

    Example, the tree in this module's docstring, root at 10 (n_i written at 11 + i):
        accepted [1, 4]: n1 (depth 1) 12 -> 11, n4 (depth 2) 15 -> 12  => [(12, 11), (15, 12)]
        accepted [0, 3]: n0 stays at 11,        n3 (depth 2) 14 -> 12  => [(14, 12)]

    Applying the moves one by one in the returned order is safe: a move's destination
    root + d is below every later move's source root + 1 + j (a later node j has depth > d
    and j >= depth - 1, because its ancestors come before it). A gather-then-scatter of all
    moves at once is safe too. Positions past the path's end are stale and get overwritten.
    """
    expected_parent = -1
    for step, node in enumerate(accepted_nodes):
        if not 0 <= node < topology.num_nodes or topology.parents[node] != expected_parent:
            raise ValueError(
                f"accepted_nodes {list(accepted_nodes)} is not a path from the root: entry "
                f"{step} is node {node}, which should be a child of {expected_parent} "
                f"(parents: {list(topology.parents)})"
            )
        expected_parent = node
    moves = []
    for depth, node in enumerate(accepted_nodes, start=1):
        src, dst = root_slot_pos + 1 + node, root_slot_pos + depth
        if src != dst:
            moves.append((src, dst))
    return moves
