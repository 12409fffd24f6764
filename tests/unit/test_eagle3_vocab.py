"""Draft vocabulary: top-k by count with exact tie and fill rules, the d2t/t2d invariants, and
check_draft_vocab / resolve_draft_vocab catching every broken mapping with a clear message."""

from __future__ import annotations

import logging

import pytest
import torch

from outrider.speculative.eagle3_vocab import (
    build_draft_vocab,
    check_draft_vocab,
    draft_target_ids,
    resolve_draft_vocab,
    t2d_from_d2t,
)


def _assert_invariants(d2t: torch.Tensor, t2d: torch.Tensor, draft: int, vocab: int) -> None:
    assert d2t.dtype == torch.int64 and d2t.shape == (draft,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab,)
    ids = torch.arange(draft) + d2t
    assert bool((ids[1:] > ids[:-1]).all())  # strictly increasing
    assert int(t2d.sum()) == draft
    assert bool(t2d[ids].all())
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab


def test_worked_example_from_the_docstring():
    counts = torch.tensor([0, 9, 1, 0, 7, 5])  # top 3: 1 (9), 4 (7), 5 (5)
    d2t, t2d = build_draft_vocab(counts, 3)
    assert d2t.tolist() == [1, 3, 3]
    assert t2d.tolist() == [False, True, False, False, True, True]


def test_ties_go_to_the_lower_id_and_zero_counts_fill_by_id():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[7, 3, 9]] = 5  # a three-way tie for two places: 3 and 7 win over 9
    counts[8] = 6
    d2t, t2d = build_draft_vocab(counts, 3)
    assert draft_target_ids(d2t).tolist() == [3, 7, 8]
    # Only 4 tokens were seen: the other 2 slots go to the lowest unseen ids, 0 and 1.
    d2t, t2d = build_draft_vocab(counts, 6)
    assert draft_target_ids(d2t).tolist() == [0, 1, 3, 7, 8, 9]
    _assert_invariants(d2t, t2d, 6, 10)
    d2t, t2d = build_draft_vocab(torch.zeros(10, dtype=torch.int64), 4)  # nothing seen
    assert draft_target_ids(d2t).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("vocab,draft", [(1, 1), (50, 50), (512, 64), (49152, 32000)])
def test_invariants_hold_on_random_counts(vocab, draft):
    g = torch.Generator().manual_seed(vocab)
    counts = torch.randint(0, 20, (vocab,), generator=g) * torch.randint(
        0, 2, (vocab,), generator=g
    )
    d2t, t2d = build_draft_vocab(counts, draft)
    _assert_invariants(d2t, t2d, draft, vocab)
    chosen = draft_target_ids(d2t)
    # Every chosen token is seen at least as often as every token left out.
    if draft < vocab:
        assert int(counts[chosen].min()) >= int(counts[~t2d].max())
    assert torch.equal(t2d_from_d2t(d2t, vocab), t2d)
    assert check_draft_vocab(d2t, t2d, vocab) == []


def test_build_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"draft_vocab_size=0 must be in 1\.\.8"):
        build_draft_vocab(torch.ones(8, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"draft_vocab_size=9 must be in 1\.\.8"):
        build_draft_vocab(torch.ones(8, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match=r"token_counts\[2\] = -1 is negative"):
        build_draft_vocab(torch.tensor([1, 2, -1, 4]), 2)
    with pytest.raises(ValueError, match="1-D"):
        build_draft_vocab(torch.ones(2, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="integer counts"):
        build_draft_vocab(torch.ones(8), 2)


def _sound(vocab: int = 100, draft: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 50, (vocab,), generator=torch.Generator().manual_seed(1))
    return build_draft_vocab(counts, draft)


def test_check_catches_a_shuffled_mapping():
    d2t, t2d = _sound()
    ids = draft_target_ids(d2t)
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))
    shuffled = ids[perm] - torch.arange(ids.numel())  # same token set, rows renamed
    (problem,) = check_draft_vocab(shuffled, t2d, 100)  # t2d still agrees: the set is the same
    assert "not strictly increasing" in problem and "lm_head rows" in problem
    # Shuffling the offsets themselves also breaks the set: t2d disagrees too.
    problems = check_draft_vocab(d2t[perm], t2d, 100)
    assert any("t2d disagrees with d2t" in p for p in problems)


def test_check_catches_range_and_t2d_breaks():
    d2t, t2d = _sound()
    assert check_draft_vocab(d2t, t2d, 100) == []
    big = d2t.clone()
    big[-1] += 1000
    (problem,) = check_draft_vocab(big, None, 100)
    assert "outside the target vocabulary [0, 100)" in problem and "slot 19" in problem
    extra = t2d.clone()
    extra[(~t2d).nonzero()[0]] = True  # one unmapped token marked
    (problem,) = check_draft_vocab(d2t, extra, 100)
    assert "t2d marks 21 tokens for 20 draft slots" in problem
    assert "shape (99,)" in check_draft_vocab(d2t, t2d[:99], 100)[0]
    assert "1-D integer" in check_draft_vocab(d2t.float(), t2d, 100)[0]


def test_resolve_derives_what_published_drafters_leave_out(caplog):
    d2t, t2d = _sound()
    got_d2t, got_t2d = resolve_draft_vocab(d2t, None, 100, 20)  # no t2d: derived
    assert torch.equal(got_t2d, t2d) and torch.equal(got_d2t, d2t)
    ident, full = resolve_draft_vocab(None, None, 100, 100)  # no d2t, full size: identity
    assert ident.tolist() == [0] * 100 and bool(full.all())
    with pytest.raises(ValueError, match="has no d2t but draft_vocab_size=20 < vocab_size=100"):
        resolve_draft_vocab(None, None, 100, 20, where="drafters/x")
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        resolve_draft_vocab(d2t + 90, None, 100, 20)
    with caplog.at_level(logging.WARNING):
        resolve_draft_vocab(d2t.flip(0), t2d, 100, 20, where="drafters/x")
    assert "drafters/x has a broken draft vocabulary" in caplog.text
