"""Batched, no-sync tree helpers (speculative/tree_batch.py) against the per-sequence
references: TreeTopology's mask and depths, a plain-Python greedy walk, accepted_kv_moves, and
eagle3_tree._select, on random trees with padding rows and score ties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outrider.speculative.eagle3_tree import _select
from outrider.speculative.tree import TreeTopology, accepted_kv_moves
from outrider.speculative.tree_batch import (
    accept_tree_greedy_no_sync,
    ancestors_no_sync,
    ancestors_np,
    select_tree_no_sync,
    tree_kv_moves_no_sync,
)

VOCAB = 64


def random_parents(rng: np.random.Generator, n: int) -> list[int]:
    """A valid tree in topological order: parents[i] in [-1, i)."""
    return [int(rng.integers(-1, i)) for i in range(n)]


def greedy_walk(parents: list[int], tokens: list[int], argmax: list[int], n: int) -> list[int]:
    """The reference: from the root, step to the child (among the n real nodes) whose token is
    the argmax at the current verify row; stop when no child matches."""
    path, cur = [], -1
    while True:
        kids = [i for i in range(n) if parents[i] == cur and tokens[i] == argmax[cur + 1]]
        assert len(kids) <= 1, "sibling tokens must be distinct"
        if not kids:
            return path
        cur = kids[0]
        path.append(cur)


def random_batch(rng: np.random.Generator, b: int, n: int, p_follow: float = 0.7):
    """B rows of N node slots: row r has num_nodes[r] real nodes (0 included: a padding row),
    sibling tokens distinct among real nodes. argmax at a verify row is one of that row's real
    children's tokens with probability p_follow. Padding nodes are made tempting: each carries
    the argmax at its parent's row, so only the num_nodes mask keeps them out."""
    parents = np.array([random_parents(rng, n) for _ in range(b)], dtype=np.int64)
    num_nodes = rng.integers(0, n + 1, size=b)
    num_nodes[0] = n  # at least one full row
    if b > 1:
        num_nodes[1] = 0  # and one padding row
    tokens = np.zeros((b, n), dtype=np.int64)
    argmax = rng.integers(0, VOCAB, size=(b, 1 + n))
    for r in range(b):
        real = int(num_nodes[r])
        for p in range(-1, real):
            kids = [i for i in range(real) if parents[r, i] == p]
            if kids:
                tokens[r, kids] = rng.choice(VOCAB, size=len(kids), replace=False)
                if rng.random() < p_follow:
                    argmax[r, p + 1] = tokens[r, rng.choice(kids)]
        for i in range(real, n):
            tokens[r, i] = argmax[r, parents[r, i] + 1]
    return parents, tokens, argmax, num_nodes


def run_accept(parents, tokens, argmax, num_nodes, extra_depth: int = 0):
    anc, depth = ancestors_np(parents)
    real_depths = [
        TreeTopology(parents[r, : num_nodes[r]].tolist()).max_depth for r in range(len(parents))
    ]
    max_depth = max(real_depths) + extra_depth
    path_rows, num_accepted = accept_tree_greedy_no_sync(
        torch.as_tensor(argmax),
        torch.as_tensor(tokens),
        torch.as_tensor(parents),
        torch.as_tensor(anc),
        torch.as_tensor(depth),
        torch.as_tensor(num_nodes),
        max_depth,
    )
    return path_rows, num_accepted, max_depth


# 1. ancestors_np


def test_ancestors_np_docstring_example() -> None:
    # Row 0 is the module docstring's tree: parents [-1, -1, 0, 1].
    anc, depth = ancestors_np(np.array([[-1, -1, 0, 1]]))
    expected = np.array(
        [
            # R  a  b  c  d
            [1, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0],  # a
            [1, 0, 1, 0, 0],  # b
            [1, 1, 0, 1, 0],  # c
            [1, 0, 1, 0, 1],  # d
        ],
        dtype=bool,
    )
    assert anc.shape == (1, 5, 5) and anc.dtype == bool
    np.testing.assert_array_equal(anc[0], expected)
    np.testing.assert_array_equal(depth, [[1, 1, 2, 2]])
    assert depth.dtype == np.int64


@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_ancestors_np_matches_tree_topology_per_row(n: int) -> None:
    rng = np.random.default_rng(n)
    b = 6
    parents = np.array([random_parents(rng, n) for _ in range(b)], dtype=np.int64)
    parents[0] = np.arange(-1, n - 1)  # a chain
    parents[1] = -1  # a star
    assert n < 3 or len({tuple(p) for p in parents.tolist()}) >= 3  # rows differ
    anc, depth = ancestors_np(parents)
    assert anc.shape == (b, 1 + n, 1 + n) and depth.shape == (b, n)
    for r in range(b):
        topo = TreeTopology(parents[r].tolist())
        np.testing.assert_array_equal(anc[r], topo.ancestor_mask().numpy(), err_msg=f"row {r}")
        assert tuple(depth[r].tolist()) == topo.depths, f"row {r}"


@pytest.mark.parametrize("n", [1, 2, 5, 16, 40])
def test_ancestors_no_sync_equals_ancestors_np(n: int) -> None:
    """The device version (squaring the parent relation) against the NumPy one, given only the
    deepest depth: chains (depth n, the most squarings), stars, random trees."""
    rng = np.random.default_rng(100 + n)
    b = 6
    parents = np.array([random_parents(rng, n) for _ in range(b)], dtype=np.int64)
    parents[0] = np.arange(-1, n - 1)  # a chain: depth n
    parents[1] = -1  # a star: depth 1
    anc, depth = ancestors_np(parents)
    got_anc, got_depth = ancestors_no_sync(torch.from_numpy(parents), int(depth.max()))
    assert got_anc.dtype == torch.bool and got_depth.dtype == torch.int64
    np.testing.assert_array_equal(got_anc.numpy(), anc)
    np.testing.assert_array_equal(got_depth.numpy(), depth)


# 2. accept_tree_greedy_no_sync


def check_against_walk(parents, tokens, argmax, num_nodes, path_rows, num_accepted, max_depth):
    b = len(parents)
    assert path_rows.shape == (b, 1 + max_depth) and num_accepted.shape == (b,)
    assert path_rows.dtype == torch.int64 and num_accepted.dtype == torch.int64
    gathered = torch.as_tensor(argmax).gather(1, path_rows)
    for r in range(b):
        n = int(num_nodes[r])
        path = greedy_walk(parents[r].tolist(), tokens[r].tolist(), argmax[r].tolist(), n)
        k = len(path)
        ctx = f"row {r}: parents {parents[r].tolist()} num_nodes {n} path {path}"
        assert int(num_accepted[r]) == k, ctx
        rows = path_rows[r].tolist()
        assert rows[: k + 1] == [0] + [1 + i for i in path], ctx
        assert rows[k + 1 :] == [rows[k]] * (max_depth - k), ctx
        # The tokens out: the accepted drafts, then the target's own token after them.
        out = gathered[r, : k + 1].tolist()
        assert out == [int(tokens[r, i]) for i in path] + [int(argmax[r, rows[k]])], ctx


@pytest.mark.parametrize("seed", range(8))
def test_accept_greedy_matches_plain_walk_on_random_trees(seed: int) -> None:
    rng = np.random.default_rng(seed)
    accepted_any = 0
    for n in range(1, 11):
        parents, tokens, argmax, num_nodes = random_batch(rng, b=5, n=n)
        extra = int(rng.integers(0, 3))
        path_rows, num_accepted, max_depth = run_accept(parents, tokens, argmax, num_nodes, extra)
        check_against_walk(parents, tokens, argmax, num_nodes, path_rows, num_accepted, max_depth)
        assert int(num_accepted[1]) == 0  # the padding row
        accepted_any += int((num_accepted >= 2).sum())
    assert accepted_any > 0  # the generator does exercise deep acceptance


def test_accept_greedy_chains_accept_all_or_stop_at_first_mismatch() -> None:
    k = 5
    parents = np.tile(np.arange(-1, k - 1), (k + 1, 1))
    tokens = np.tile(np.arange(10, 10 + k), (k + 1, 1))
    argmax = np.full((k + 1, 1 + k), 99)
    for r in range(k + 1):  # row r's target agrees with the first r drafts only
        argmax[r, :r] = tokens[r, :r]
    num_nodes = np.full(k + 1, k)
    path_rows, num_accepted, max_depth = run_accept(parents, tokens, argmax, num_nodes)
    assert num_accepted.tolist() == list(range(k + 1))
    check_against_walk(parents, tokens, argmax, num_nodes, path_rows, num_accepted, max_depth)


# The module docstring's tree: parents [-1, -1, 0, 1], tokens [a, b, c, d], rows r, a, b, c, d.
A, B, C, D, X, Y, Z, W = 11, 12, 13, 14, 21, 22, 23, 24


def test_accept_greedy_docstring_example() -> None:
    # Row 0 says a and row 1 (a's) says c: a and c are accepted, row 3 (c's) gives the bonus z.
    # (The docstring lists argmax as [a, x, y, c, z], which would put x at a's row and end the
    # path after a; its own narrative, "row 1 says c" and tokens out [a, c, z], needs this row.)
    parents = np.array([[-1, -1, 0, 1]])
    tokens = np.array([[A, B, C, D]])
    argmax = np.array([[A, C, Y, Z, W]])
    path_rows, num_accepted, _ = run_accept(parents, tokens, argmax, np.array([4]))
    assert num_accepted.tolist() == [2]
    assert path_rows.tolist() == [[0, 1, 3]]
    assert torch.as_tensor(argmax).gather(1, path_rows).tolist() == [[A, C, Z]]
    # KV: c (node 2) was written at root + 3 and moves to root + 2; a stays at root + 1.
    src, dst = tree_kv_moves_no_sync(path_rows, num_accepted, torch.tensor([10]))
    assert src.tolist() == [[11, 13]] and dst.tolist() == [[11, 12]]
    assert accepted_kv_moves(TreeTopology((-1, -1, 0, 1)), [0, 2], 10) == [(13, 12)]


def test_accept_greedy_docstring_argmax_as_printed() -> None:
    # The argmax row exactly as the docstring prints it, [a, x, y, c, z]: a's row says x, so only
    # a is accepted and the target's token after it is x.
    parents = np.array([[-1, -1, 0, 1]])
    tokens = np.array([[A, B, C, D]])
    argmax = np.array([[A, X, Y, C, Z]])
    path_rows, num_accepted, max_depth = run_accept(parents, tokens, argmax, np.array([4]))
    assert num_accepted.tolist() == [1]
    assert path_rows.tolist() == [[0, 1, 1]]
    check_against_walk(parents, tokens, argmax, np.array([4]), path_rows, num_accepted, max_depth)


def test_accept_greedy_padding_rows_and_padding_nodes_never_accept() -> None:
    # Row 0: no real nodes although every slot would match; row 1: only node 0 is real, node 1
    # (its child, matching) is padding.
    parents = np.array([[-1, 0, 1], [-1, 0, 1]])
    tokens = np.array([[A, B, C], [A, B, C]])
    argmax = np.array([[A, B, C, D], [A, B, C, D]])
    path_rows, num_accepted, _ = run_accept(parents, tokens, argmax, np.array([0, 1]), 1)
    assert num_accepted.tolist() == [0, 1]
    assert path_rows.tolist() == [[0, 0, 0], [0, 1, 1]]


# 3. tree_kv_moves_no_sync


@pytest.mark.parametrize("seed", range(4))
def test_kv_moves_match_accepted_kv_moves(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    moved_any = 0
    for n in range(1, 11):
        parents, tokens, argmax, num_nodes = random_batch(rng, b=5, n=n)
        path_rows, num_accepted, max_depth = run_accept(
            parents, tokens, argmax, num_nodes, int(rng.integers(0, 3))
        )
        starts = torch.as_tensor(rng.integers(0, 1000, size=5))
        src, dst = tree_kv_moves_no_sync(path_rows, num_accepted, starts)
        assert src.shape == dst.shape == (5, max_depth)
        for r in range(5):
            k, root = int(num_accepted[r]), int(starts[r])
            path = [row - 1 for row in path_rows[r, 1 : k + 1].tolist()]
            topo = TreeTopology(parents[r, : num_nodes[r]].tolist())
            expected = accepted_kv_moves(topo, path, root)
            got = [(s, d) for s, d in zip(src[r, :k].tolist(), dst[r, :k].tolist()) if s != d]
            assert got == expected, f"row {r}: parents {parents[r].tolist()} path {path}"
            assert dst[r].tolist() == list(range(root + 1, root + 1 + max_depth))
            assert src[r, k:].tolist() == dst[r, k:].tolist()  # past the path: onto itself
            moved_any += len(expected)
    assert moved_any > 0


# 4. select_tree_no_sync


def eagle_candidates(rng: np.random.Generator, b: int, s: int, t: int, ties: bool):
    """Candidates grown the way EAGLE does: depth 0 scores are log-probs <= 0; a deeper node
    picks a parent among the previous depth's t and scores parent + a log-prob <= 0. With ties,
    log-probs come from a coarse grid that includes exactly 0 (a child tying its parent)."""
    tokens = rng.integers(0, VOCAB, size=(b, s, t))
    parents = np.full((b, s, t), -1, dtype=np.int64)
    scores = np.zeros((b, s, t), dtype=np.float32)

    def logp(size):
        if ties:
            return -rng.integers(0, 4, size=size) * 0.5  # exact in float32: sums tie exactly
        return np.log(rng.uniform(0.01, 1.0, size=size))

    for r in range(b):
        first = logp(t)
        scores[r, 0] = np.sort(first)[::-1] if rng.random() < 0.5 else first
        for d in range(1, s):
            parents[r, d] = rng.integers(0, t, size=t)
            scores[r, d] = scores[r, d - 1, parents[r, d]] + logp(t)
    if ties:
        scores[0] = 0.0  # everything ties: depth, then index decides
    if ties and s > 1:
        scores[1, 1, :] = scores[1, 0, parents[1, 1, :]]  # every depth-1 child ties its parent
    return (torch.as_tensor(x) for x in (tokens, scores, parents))


@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize(("s", "t"), [(1, 1), (1, 4), (3, 1), (3, 2), (4, 4), (5, 3)])
def test_select_matches_eagle3_select_per_row(s: int, t: int, ties: bool) -> None:
    rng = np.random.default_rng(10 * s + t + ties)
    b = 5
    tokens, scores, parents = eagle_candidates(rng, b, s, t, ties)
    for num_nodes in range(1, s * t + 1):
        out_tokens, out_parents = select_tree_no_sync(tokens, scores, parents, num_nodes)
        assert out_tokens.shape == out_parents.shape == (b, num_nodes)
        for r in range(b):
            ref = _select(tokens[r].tolist(), scores[r].tolist(), parents[r].tolist(), num_nodes)
            ctx = f"row {r} num_nodes {num_nodes} scores {scores[r].tolist()}"
            assert out_tokens[r].tolist() == ref.token_ids, ctx
            assert out_parents[r].tolist() == ref.parents, ctx
            assert all(-1 <= p < j for j, p in enumerate(out_parents[r].tolist())), ctx


def test_select_keeps_a_child_that_ties_its_parent_after_the_parent() -> None:
    # One row, t = 2, 2 depths. Scores: depth 0 [-1, -0.5]; depth 1 nodes hang under index 1
    # (score -0.5) with log-probs 0 and -2: the first child ties its parent at -0.5. Best 3:
    # (0, 1) -0.5, (1, 0) -0.5 (a tie, the shallower first), (0, 0) -1.
    tokens = torch.tensor([[[5, 6], [7, 8]]])
    scores = torch.tensor([[[-1.0, -0.5], [-0.5, -2.5]]])
    parents = torch.tensor([[[-1, -1], [1, 1]]])
    out_tokens, out_parents = select_tree_no_sync(tokens, scores, parents, 3)
    assert out_tokens.tolist() == [[5, 6, 7]]
    assert out_parents.tolist() == [[-1, -1, 1]]
    out_tokens, out_parents = select_tree_no_sync(tokens, scores, parents, 2)
    assert out_tokens.tolist() == [[6, 7]] and out_parents.tolist() == [[-1, 0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accept_kv_moves_and_select_replay_in_a_cuda_graph() -> None:
    rng = np.random.default_rng(0)
    b, n, s, t, keep = 4, 8, 3, 4, 7
    dev = torch.device("cuda")

    def inputs() -> list[torch.Tensor]:
        parents, tokens, argmax, num_nodes = random_batch(rng, b, n)
        anc, depth = ancestors_np(parents)
        cands = eagle_candidates(rng, b, s, t, ties=True)
        starts = rng.integers(0, 50, size=b)
        host = (argmax, tokens, parents, anc, depth, num_nodes, starts)
        return [torch.as_tensor(x) for x in host] + list(cands)

    def body(argmax, tokens, parents, anc, depth, num_nodes, starts, c_tok, c_score, c_par):
        path_rows, num_accepted = accept_tree_greedy_no_sync(
            argmax, tokens, parents, anc, depth, num_nodes, n
        )
        src, dst = tree_kv_moves_no_sync(path_rows, num_accepted, starts)
        sel = select_tree_no_sync(c_tok, c_score, c_par, keep)
        return (path_rows, num_accepted, src, dst, *sel)

    statics = [x.to(dev) for x in inputs()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(*statics)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body(*statics)
    for _ in range(3):
        fresh = inputs()
        for static, x in zip(statics, fresh):
            static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, body(*fresh)):
            assert torch.equal(got.cpu(), want)
