"""Tree topology: chains, a branching tree's shape, its verify mask, and the KV compaction after
acceptance, against hand-written expectations."""

from __future__ import annotations

import pytest
import torch

from outrider.speculative.tree import TreeTopology, accepted_kv_moves, verify_mask

# The module docstring's example:
#              root
#            /      \
#          n0        n1
#         /  \         \
#       n2    n3        n4
BRANCHY = (-1, -1, 0, 0, 1)


def test_chain_mask_is_lower_triangular_positions_consecutive_and_no_kv_moves() -> None:
    chain = TreeTopology.chain(4)
    assert chain.parents == (-1, 0, 1, 2)
    assert chain.is_chain and chain.num_nodes == 4
    assert chain.depths == (1, 2, 3, 4)
    assert chain.positions(7) == [7, 8, 9, 10, 11]
    assert torch.equal(chain.ancestor_mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    assert chain.paths() == [[0, 1, 2, 3]]
    for n in range(5):
        assert accepted_kv_moves(chain, list(range(n)), 7) == []


def test_empty_chain_is_just_the_root() -> None:
    empty = TreeTopology.chain(0)
    assert empty.num_nodes == 0 and empty.is_chain
    assert empty.positions(3) == [3]
    assert torch.equal(empty.ancestor_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert empty.paths() == [] and empty.children(-1) == []


def test_branching_tree_depths_children_paths_positions() -> None:
    tree = TreeTopology.from_parents(list(BRANCHY))
    assert not tree.is_chain
    assert tree.num_nodes == 5
    assert tree.depths == (1, 1, 2, 2, 2)
    assert tree.max_depth == 2
    assert tree.children(-1) == [0, 1]
    assert tree.children(0) == [2, 3]
    assert tree.children(1) == [4]
    assert tree.children(4) == []
    assert tree.paths() == [[0, 2], [0, 3], [1, 4]]
    assert tree.positions(10) == [10, 11, 11, 12, 12, 12]


def test_branching_tree_ancestor_mask_matches_hand_written_matrix() -> None:
    expected = torch.tensor(
        [
            # R  n0 n1 n2 n3 n4
            [1, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0],  # n0
            [1, 0, 1, 0, 0, 0],  # n1
            [1, 1, 0, 1, 0, 0],  # n2
            [1, 1, 0, 0, 1, 0],  # n3
            [1, 0, 1, 0, 0, 1],  # n4
        ],
        dtype=torch.bool,
    )
    assert torch.equal(TreeTopology(BRANCHY).ancestor_mask(), expected)


def test_deeper_tree_mask_follows_ancestors_not_node_order() -> None:
    # root -> n0 -> n2 -> n4 ; root -> n1 -> n3 : node order interleaves the two branches.
    tree = TreeTopology((-1, -1, 0, 1, 2))
    mask = tree.ancestor_mask()
    assert mask[1 + 4].tolist() == [True, True, False, True, False, True]
    assert mask[1 + 3].tolist() == [True, False, True, False, True, False]
    assert tree.paths() == [[1, 3], [0, 2, 4]]
    assert tree.positions(0) == [0, 1, 1, 2, 2, 3]


def test_verify_mask_sees_the_whole_prefix_then_the_tree() -> None:
    tree = TreeTopology(BRANCHY)
    mask = verify_mask(tree, prefix_len=4)
    assert mask.shape == (6, 4 + 6) and mask.dtype == torch.bool
    assert mask[:, :4].all()
    assert torch.equal(mask[:, 4:], tree.ancestor_mask())
    assert torch.equal(verify_mask(tree, 0), tree.ancestor_mask())
    with pytest.raises(ValueError, match="prefix_len"):
        verify_mask(tree, -1)


def test_kv_moves_compact_an_accepted_branch_that_is_not_contiguous() -> None:
    tree = TreeTopology(BRANCHY)
    # Root at 10; the verify wrote n_i at 11 + i. Path n1 -> n4 must end at 11, 12.
    assert accepted_kv_moves(tree, [1, 4], 10) == [(12, 11), (15, 12)]
    assert accepted_kv_moves(tree, [0, 3], 10) == [(14, 12)]
    assert accepted_kv_moves(tree, [0, 2], 10) == [(13, 12)]
    assert accepted_kv_moves(tree, [0], 10) == []  # n0 already sits at 11
    assert accepted_kv_moves(tree, [1], 10) == [(12, 11)]
    assert accepted_kv_moves(tree, [], 10) == []


def test_kv_moves_applied_in_order_never_read_an_overwritten_slot() -> None:
    # Interleaved branches: path n1 -> n3 -> n5 -> n7 sits at 2, 4, 6, 8 behind a root at 0.
    tree = TreeTopology((-1, -1, 0, 1, 2, 3, 4, 5))
    path = [1, 3, 5, 7]
    kv = list(range(1 + tree.num_nodes))  # kv[pos] = which query wrote it (0 = root)
    for src, dst in accepted_kv_moves(tree, path, 0):
        kv[dst] = kv[src]
    assert kv[1 : 1 + len(path)] == [1 + n for n in path]


def test_kv_moves_refuse_a_non_path() -> None:
    tree = TreeTopology(BRANCHY)
    with pytest.raises(ValueError, match="not a path from the root"):
        accepted_kv_moves(tree, [0, 4], 10)  # n4 hangs under n1, not n0
    with pytest.raises(ValueError, match="not a path from the root"):
        accepted_kv_moves(tree, [2], 10)  # n2 is not a child of the root
    with pytest.raises(ValueError, match="not a path from the root"):
        accepted_kv_moves(tree, [9], 10)


@pytest.mark.parametrize(
    ("parents", "bad"),
    [((0,), "parents\\[0\\] = 0"), ((-1, 1), "parents\\[1\\] = 1"), ((-1, 0, -2), "\\[2\\]")],
)
def test_invalid_parents_raise_naming_the_index(parents: tuple[int, ...], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        TreeTopology.from_parents(parents)


def test_chain_rejects_negative_length_and_children_rejects_unknown_node() -> None:
    with pytest.raises(ValueError, match="k=-1"):
        TreeTopology.chain(-1)
    with pytest.raises(ValueError, match="no node 5"):
        TreeTopology(BRANCHY).children(5)


def test_mask_on_a_device_and_topology_is_hashable() -> None:
    tree = TreeTopology(BRANCHY)
    assert tree.ancestor_mask("cpu").device.type == "cpu"
    assert {tree: 1}[TreeTopology.from_parents(list(BRANCHY))] == 1
    # from_parents shares one instance per shape, so depths/children are computed once.
    assert TreeTopology.from_parents(list(BRANCHY)) is TreeTopology.from_parents(BRANCHY)
