"""Acceptance: greedy walks, verify_sampled == verify_greedy on one-hot rows, seeds, edge cases,
and the central statistical test: whatever the drafts, the emitted tokens follow the target.

The lossless tests build a small world over a vocabulary of V tokens: the target's next-token
distribution is a fixed table per prefix (p[0] after the root, p[1][a] after token a, p[2][a, b]
after a, b), the drafter's is another (q). Drafts are drawn from q exactly as a proposer would;
verify_sampled runs once per trial; the first 1, 2 and 3 emitted tokens (continued by plain
sampling from p where a verdict is shorter) must match p0(a), p0(a) p1(b|a), p0 p1 p2(c|a,b)
by chi-square. The same harness must reject a deliberately wrong verifier.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from outrider.speculative.tree import TreeTopology
from outrider.speculative.verify import (
    Verdict,
    drop_no_sync,
    proposal_no_sync,
    residual_no_sync,
    verify_greedy,
    verify_sampled,
)

V = 5
# 1e5 trials per lossless test (verify_sampled costs ~0.2 ms a call on CPU, so ~25 s a test on
# 2 cores). With 1e5, a bias of 0.004 on a cell of probability 0.2 gives a chi-square
# noncentrality of ~9; the wrong verifiers below are caught at p < 1e-6 with 20k.
TRIALS = 100_000
POWER_TRIALS = 20_000
CHAIN2 = TreeTopology.chain(2)
# root -> n0 -> {n2, n3}; root -> n1 -> n4: two siblings at both levels, and a lone child.
TREE = TreeTopology((-1, -1, 0, 0, 1))

Verifier = Callable[..., Verdict]


# --- the world: target and draft distributions as functions of the prefix -------------------


def _table(level: int, gen: torch.Generator) -> torch.Tensor:
    """[V] * level + [V] float32 rows; about a third have one zero entry, so that drafted
    tokens with p(x) = 0 and targets with q(x) = 0 both occur."""
    rows = (torch.rand(V**level, V, generator=gen) ** 2 + 0.01).float()
    hit = torch.rand(V**level, generator=gen) < 0.3
    col = torch.randint(V, (V**level,), generator=gen)
    rows[hit, col[hit]] = 0.0
    rows /= rows.sum(-1, keepdim=True)
    return rows.reshape(*([V] * level), V)


def make_world(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    p = [_table(level, gen) for level in range(3)]
    q = [_table(level, gen) for level in range(2)]
    return p, q


def node_paths(topo: TreeTopology) -> list[list[int]]:
    """For each node, the nodes from the root's child down to it."""
    out: list[list[int]] = []
    for parent in topo.parents:
        out.append((out[parent] if parent >= 0 else []) + [len(out)])
    return out


def row_of(table: list[torch.Tensor], tokens: torch.Tensor, path: list[int]) -> torch.Tensor:
    """[T, V]: the table's row after the prefix tokens[:, path] (level len(path))."""
    t = tokens.shape[0]
    if not path:
        return table[0].expand(t, V)
    return table[len(path)][tuple(tokens[:, n] for n in path)]


def without_replacement(q: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] picks from q [T, V], one after another, each pick zeroed before the next."""
    q = q.clone()
    picks = []
    for _ in range(k):
        x = torch.multinomial(q, 1, generator=gen)
        picks.append(x.squeeze(1))
        q.scatter_(1, x, 0.0)
    return torch.stack(picks, dim=1)


def draft(topo: TreeTopology, q: list[torch.Tensor], how: str, trials: int, gen: torch.Generator):
    """tokens [T, N] for every trial. how: 'sampled' (children of a node drawn from its q
    without replacement; a chain is ancestral sampling), 'iid' (with replacement),
    'deterministic' (distinct arbitrary tokens, as a lookup proposer gives), 'by_rank' (the
    top-k of q, EAGLE's deterministic top-k). Returns tokens and the draft rows [T, N, V]."""
    paths = node_paths(topo)
    tokens = torch.zeros(trials, topo.num_nodes, dtype=torch.long)
    for parent in [-1, *range(topo.num_nodes)]:
        kids = topo.children(parent)
        if not kids:
            continue
        q_row = row_of(q, tokens, paths[parent] if parent >= 0 else [])
        if how == "sampled":
            picks = without_replacement(q_row, len(kids), gen)
        elif how == "iid":
            picks = torch.multinomial(q_row, len(kids), replacement=True, generator=gen)
        elif how == "deterministic":
            picks = without_replacement(torch.ones(trials, V), len(kids), gen)
        else:
            picks = q_row.topk(len(kids), dim=-1).indices
        tokens[:, kids] = picks
    draft_rows = torch.stack([row_of(q, tokens, path[:-1]) for path in paths], dim=1)
    return tokens, draft_rows


def emitted_tokens(
    topo: TreeTopology,
    p: list[torch.Tensor],
    tokens: torch.Tensor,
    draft_rows: torch.Tensor | None,
    verifier: Verifier,
    gen: torch.Generator,
) -> torch.Tensor:
    """[T, 3]: each trial's first three emitted tokens, continued by plain target sampling
    (a plain decode step, or the next verify, which the 1-token test covers) when short."""
    trials = tokens.shape[0]
    paths = node_paths(topo)
    target_rows = torch.stack(
        [row_of(p, tokens, [])] + [row_of(p, tokens, path) for path in paths], dim=1
    )  # [T, 1 + N, V]
    heads = []
    token_lists = tokens.tolist()
    for t in range(trials):
        q_rows = None if draft_rows is None else draft_rows[t]
        verdict = verifier(topo, token_lists[t], target_rows[t], q_rows, gen)
        heads.append((verdict.token_ids + [-1, -1])[:3])
    out = torch.tensor(heads)
    for col in (1, 2):
        short = out[:, col] < 0
        rows = row_of(p, out[short], list(range(col)))
        out[short, col] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
    return out


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square against probs (float64), cells expected below 5 pooled into one.
    A count in a zero-probability cell is impossible under probs: p-value 0."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exp = n * probs
    big = exp >= 5
    obs_cells = torch.cat([counts[big], counts[~big & (probs > 0)].sum().view(1)])
    exp_cells = torch.cat([exp[big], exp[~big & (probs > 0)].sum().view(1)])
    if exp_cells[-1] < 5:  # the pooled cell is still small: fold it into the largest cell
        obs_cells[exp_cells[:-1].argmax()] += obs_cells[-1]
        exp_cells[exp_cells[:-1].argmax()] += exp_cells[-1]
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    chi2 = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    df = obs_cells.numel() - 1
    # survival function of chi2(df)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), chi2 / 2))


def lossless_pvalues(out: torch.Tensor, p: list[torch.Tensor]) -> list[float]:
    """p-values of the first 1, 2 and 3 emitted tokens against the target's own law."""
    p0, p1, p2 = (t.double() for t in p)
    joint2 = p0[:, None] * p1  # [V, V]
    joint3 = joint2[:, :, None] * p2  # [V, V, V]
    out = out.long()
    c1 = torch.bincount(out[:, 0], minlength=V).double()
    c2 = torch.bincount(out[:, 0] * V + out[:, 1], minlength=V**2).double()
    c3 = torch.bincount((out[:, 0] * V + out[:, 1]) * V + out[:, 2], minlength=V**3).double()
    return [
        chi2_pvalue(c1, p0),
        chi2_pvalue(c2, joint2.flatten()),
        chi2_pvalue(c3, joint3.flatten()),
    ]


def run_lossless(
    topo: TreeTopology,
    how: str,
    with_q: bool,
    seed: int,
    trials: int = TRIALS,
    verifier: Verifier = verify_sampled,
) -> list[float]:
    p, q = make_world(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens, draft_rows = draft(topo, q, how, trials, gen)
    out = emitted_tokens(topo, p, tokens, draft_rows if with_q else None, verifier, gen)
    return lossless_pvalues(out, p)


# --- the central tests -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topo", "how", "with_q", "trials"),
    [
        (CHAIN2, "sampled", True, TRIALS),
        (CHAIN2, "deterministic", False, TRIALS),
        (TREE, "sampled", True, TRIALS),
        (TREE, "deterministic", False, TRIALS),
        # Documented extras, with fewer trials: sampled drafts verified as if deterministic
        # (lossless, only accepted less often); siblings drawn with replacement.
        (CHAIN2, "sampled", False, POWER_TRIALS),
        (TREE, "iid", True, POWER_TRIALS),
    ],
    ids=["chain_q", "chain_onehot", "tree_q", "tree_onehot", "chain_q_as_onehot", "tree_iid"],
)
def test_emitted_tokens_follow_the_target(
    topo: TreeTopology, how: str, with_q: bool, trials: int
) -> None:
    pvalues = run_lossless(topo, how, with_q, seed=11, trials=trials)
    # Three statistics per test: Bonferroni keeps the test's own false-alarm rate at 1%.
    assert min(pvalues) * len(pvalues) > 0.01, pvalues


def _accept_always(topo, tokens, target_rows, draft_rows, gen) -> Verdict:
    path = topo.paths()[0]
    bonus = int(torch.multinomial(target_rows[1 + path[-1]], 1, generator=gen))
    return Verdict(path, [tokens[n] for n in path] + [bonus])


@pytest.mark.slow
def test_power_the_same_test_rejects_an_accept_everything_verifier() -> None:
    pvalues = run_lossless(CHAIN2, "sampled", True, 11, POWER_TRIALS, _accept_always)
    assert pvalues[0] < 1e-6, pvalues


@pytest.mark.slow
def test_power_rank_top_k_drafts_passed_with_q_are_caught() -> None:
    # EAGLE-style top-k by rank is deterministic; claiming the drafts came from q is lossy.
    pvalues = run_lossless(TREE, "by_rank", True, 11, POWER_TRIALS)
    assert min(pvalues) < 1e-6, pvalues
    # ... and the same drafts passed honestly (draft_probs=None) are lossless.
    honest = run_lossless(TREE, "by_rank", False, 11, POWER_TRIALS)
    assert min(honest) * len(honest) > 0.01, honest


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_chain_all_accepted_appends_the_bonus() -> None:
    v = verify_greedy(TreeTopology.chain(3), [4, 8, 15], [4, 8, 15, 16])
    assert v.accepted_nodes == [0, 1, 2] and v.token_ids == [4, 8, 15, 16]
    assert v.num_accepted == 3 and len(v.token_ids) == 3 + 1


def test_greedy_chain_first_rejected_gives_only_the_correction() -> None:
    v = verify_greedy(TreeTopology.chain(3), [4, 8, 15], [5, 8, 15, 16])
    assert v.accepted_nodes == [] and v.token_ids == [5]
    v = verify_greedy(TreeTopology.chain(3), [4, 8, 15], [4, 9, 15, 16])
    assert v.accepted_nodes == [0] and v.token_ids == [4, 9]


def test_greedy_tree_follows_the_matching_branch() -> None:
    # n0=5, n1=7 under the root; n2=8, n3=9 under n0; n4=3 under n1.
    tokens = [5, 7, 8, 9, 3]
    # rows: root, n0, n1, n2, n3, n4 -> the root wants 7 (n1), n1 wants 3 (n4), n4 wants 11.
    v = verify_greedy(TREE, tokens, [7, 0, 3, 0, 0, 11])
    assert v.accepted_nodes == [1, 4] and v.token_ids == [7, 3, 11]
    v = verify_greedy(TREE, tokens, [5, 9, 0, 0, 12, 0])  # n0 then its second child n3
    assert v.accepted_nodes == [0, 3] and v.token_ids == [5, 9, 12]
    v = verify_greedy(TREE, tokens, [5, 4, 0, 0, 0, 0])  # n0, then no child matches 4
    assert v.accepted_nodes == [0] and v.token_ids == [5, 4]


def test_no_drafts_emits_one_token() -> None:
    empty = TreeTopology.chain(0)
    assert verify_greedy(empty, [], [6]).token_ids == [6]
    one_hot = torch.zeros(1, 8)
    one_hot[0, 6] = 1.0
    assert verify_sampled(empty, [], one_hot).token_ids == [6]


def _random_topology(gen: torch.Generator) -> TreeTopology:
    n = int(torch.randint(0, 7, (), generator=gen))
    if torch.rand((), generator=gen) < 0.3:
        return TreeTopology.chain(n)
    return TreeTopology(tuple(int(torch.randint(-1, i, (), generator=gen)) for i in range(n)))


def test_sampled_with_one_hot_targets_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    for case in range(400):
        topo = _random_topology(gen)
        n = topo.num_nodes
        argmax = torch.randint(vocab, (1 + n,), generator=gen)
        # Half the drafts copy what their parent's row wants, so long paths get accepted.
        tokens = torch.randint(vocab, (n,), generator=gen)
        copy = torch.rand(n, generator=gen) < 0.6
        for i, parent in enumerate(topo.parents):
            if copy[i]:
                tokens[i] = argmax[parent + 1]
        kind = case % 3
        if kind == 0:
            draft_probs = None
        else:
            draft_probs = torch.rand(n, vocab, generator=gen) ** 3
            if kind == 2:  # some zeros, including at drafted tokens
                draft_probs[torch.rand(n, vocab, generator=gen) < 0.3] = 0.0
            draft_probs[:, 0] += 1e-3
            draft_probs /= draft_probs.sum(-1, keepdim=True)
        target = torch.nn.functional.one_hot(argmax, vocab).float()
        want = verify_greedy(topo, tokens.tolist(), argmax.tolist())
        got = verify_sampled(topo, tokens.tolist(), target, draft_probs, gen)
        assert got == want, (case, topo.parents, tokens.tolist(), argmax.tolist())


# --- seeds and edge cases --------------------------------------------------------------------


def _random_case(topo: TreeTopology, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = topo.num_nodes
    target = torch.rand(1 + n, 7, generator=gen).softmax(-1)
    draft_probs = torch.rand(n, 7, generator=gen).softmax(-1)
    tokens = torch.randint(7, (n,), generator=gen).tolist()
    return tokens, target, draft_probs


@pytest.mark.parametrize("topo", [TreeTopology.chain(4), TREE], ids=["chain", "tree"])
def test_same_seed_same_verdicts(topo: TreeTopology) -> None:
    tokens, target, draft_probs = _random_case(topo, 0)

    def verdicts(seed: int) -> list[Verdict]:
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed + 1000)  # the default RNG must not matter
        return [verify_sampled(topo, tokens, target, draft_probs, gen) for _ in range(60)]

    assert verdicts(5) == verdicts(5)
    assert verdicts(5) != verdicts(6)


def test_draft_equal_to_target_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(0)
    for topo in (TreeTopology.chain(4), TREE):
        tokens, target, _ = _random_case(topo, 1)
        # q = the target's own row at each node's parent: min(1, p/q) = 1.
        q = torch.stack([target[1 + parent] for parent in topo.parents])
        for _ in range(50):
            v = verify_sampled(topo, tokens, target, q, gen)
            assert v.accepted_nodes == topo.paths()[0]


def test_a_token_its_q_cannot_produce_is_verified_as_a_deterministic_draft() -> None:
    # Draft 0 although q is one-hot at 1: verified as one-hot at 0, it is accepted w.p. p(0)
    # and a rejection draws from p without 0. (norm(max(0, p - q)) would give 0 instead.)
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    seen = {(0, 2): 0, (1,): 0}
    for _ in range(400):
        v = verify_sampled(TreeTopology.chain(1), [0], target, q, gen)
        seen[tuple(v.token_ids)] += 1
    assert 150 < seen[(0, 2)] < 250, seen
    # Greedy row: the argmax is accepted even though q gave it no mass, as verify_greedy does.
    greedy = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_sampled(TreeTopology.chain(1), [0], greedy, q, gen).token_ids == [0, 2]


def test_a_repeated_sibling_cannot_be_accepted_twice() -> None:
    # Siblings 0, 0: the second is not in q without 0, so it is verified as one-hot at 0
    # against p = norm(max(0, p - q)) = [0, 0.5, 0.5], which never accepts it.
    topo = TreeTopology((-1, -1))
    target = torch.tensor([[0.2, 0.4, 0.4], [1.0, 0, 0], [1.0, 0, 0]])
    q = torch.tensor([[0.6, 0.2, 0.2], [0.6, 0.2, 0.2]])
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        v = verify_sampled(topo, [0, 0], target, q, gen)
        assert v.accepted_nodes in ([], [0])
        seen.add(tuple(v.token_ids))
    assert seen == {(0, 0), (1,), (2,)}


def test_per_node_math_edge_cases() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_no_sync(p, q), torch.tensor([1.0, 0.0, 0.0]))
    # p == q: no residual mass (rejection was impossible) -> p, no NaN.
    assert torch.equal(residual_no_sync(p, p.clone()), p)
    # batched over rows, as a GPU-batched verifier would call it
    both = residual_no_sync(torch.stack([p, p]), torch.stack([q, p]))
    assert torch.allclose(both, torch.stack([torch.tensor([1.0, 0.0, 0.0]), p]))
    # q(x) = 0 -> one-hot proposal at x; q(x) > 0 -> q unchanged.
    qs, q_x = proposal_no_sync(
        torch.stack([q, q.index_fill(0, torch.tensor([2]), 0.0)]), torch.tensor([1, 2])
    )
    assert torch.equal(qs[0], q) and torch.equal(qs[1], torch.tensor([0.0, 0.0, 1.0]))
    assert q_x.tolist() == pytest.approx([0.6, 1.0])
    # Deterministic drafts: p without the token, renormalized; p itself when nothing is left.
    assert torch.allclose(drop_no_sync(p, torch.tensor([0])), torch.tensor([0.0, 0.6, 0.4]))
    hot = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(drop_no_sync(hot, torch.tensor([1])), hot)


def test_bad_inputs_name_the_sizes() -> None:
    target = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="the tree has 2 nodes, draft_tokens has 1"):
        verify_sampled(CHAIN2, [1], target)
    with pytest.raises(ValueError, match="target_probs rows has 2"):
        verify_sampled(CHAIN2, [1, 2], target[:2])
    with pytest.raises(ValueError, match=r"draft_probs has shape \(2, 3\)"):
        verify_sampled(CHAIN2, [1, 2], target, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"draft tokens \[4\] are outside"):
        verify_sampled(CHAIN2, [1, 4], target)
    with pytest.raises(ValueError, match="target_argmax has 2"):
        verify_greedy(CHAIN2, [1, 2], [1, 2])
