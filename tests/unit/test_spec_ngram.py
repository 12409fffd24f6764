"""NgramProposer: exact drafts on hand-made sequences, incremental == a naive reference at every
step, copying from the prompt, the shared cache, forget/shrink handling and config validation."""

from __future__ import annotations

import random

import pytest

from outrider.core import Request, SamplingParams
from outrider.speculative.base import Proposer, SeqDrafts
from outrider.speculative.ngram import NgramConfig, NgramProposer

A, B, C, D, E, X, Y, Z = range(10, 18)


def req(prompt: list[int], output: list[int] | None = None, rid: str | None = None) -> Request:
    r = Request(prompt_token_ids=list(prompt), params=SamplingParams(temperature=0))
    r.output_token_ids = list(output or [])
    if rid is not None:
        r.request_id = rid
    return r


def draft(tokens: list[int], k: int = 4, min_n: int = 1, max_n: int = 4, cap: int = 64) -> list:
    proposer = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n, num_draft_tokens=k))
    (d,) = proposer.propose([req(tokens)], cap)
    assert d.is_chain and d.draft_probs is None
    return d.token_ids


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """O(L^2): longest n first, then the latest earlier occurrence, drafts cut at the end."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= end:
            continue
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_satisfies_the_proposer_protocol():
    proposer: Proposer = NgramProposer(NgramConfig())
    assert proposer.name == "ngram"
    (d,) = proposer.propose([req([A, B, A])], 4)
    assert isinstance(d, SeqDrafts)


def test_longest_n_wins_over_a_more_recent_shorter_match():
    # Suffix (c, a, b): the 3-gram occurs at 1..3 -> draft tokens[4:]; the 2-gram (a, b) also
    # occurs later at 6..7, which must lose to the longer match.
    tokens = [X, C, A, B, D, E, A, B, Y, C, A, B]
    assert draft(tokens, k=2) == [D, E]
    assert draft(tokens, k=2, max_n=2) == [Y, C]  # only n <= 2: the latest (a, b) wins


def test_most_recent_occurrence_wins_among_equal_n():
    tokens = [A, B, C, X, A, B, D, Y, A, B]
    assert draft(tokens, k=2, max_n=2) == [D, Y]  # (a, b) at 4..5, not at 0..1
    assert reference(tokens, 1, 2, 2) == [D, Y]


def test_k_cap_and_max_draft_tokens_cap():
    tokens = [A, B, C, D, E, X, Y, A, B]
    assert draft(tokens, k=4) == [C, D, E, X]
    assert draft(tokens, k=2) == [C, D]
    assert draft(tokens, k=4, cap=3) == [C, D, E]
    assert draft(tokens, k=4, cap=0) == []


def test_negative_max_draft_tokens_is_an_error():
    with pytest.raises(ValueError, match="max_draft_tokens=-1"):
        NgramProposer(NgramConfig()).propose([req([A, B])], -1)


def test_no_match_gives_an_empty_draft():
    assert draft([A, B, C, D]) == []
    assert draft([]) == []
    assert draft([A]) == []


def test_min_n_is_respected():
    tokens = [A, B, C, X, Y, B]  # only a 1-gram match (b at 1)
    assert draft(tokens, k=2, min_n=1) == [C, X]
    assert draft(tokens, k=2, min_n=2) == []


def test_repeating_pattern_drafts_may_overlap_the_suffix():
    # a b a b a, n = 2: suffix (b, a) at 3..4 matches 1..2, drafts tokens[3:5] = the suffix itself.
    assert draft([A, B, A, B, A], k=4, max_n=2) == [B, A]
    # With n up to 4, (a, b, a) at 2..4 matches 0..2: the same two tokens follow.
    assert draft([A, B, A, B, A], k=4, max_n=4) == [B, A]
    # One token repeated: the latest earlier (a, a, a, a) starts at 1, one token remains after it.
    assert draft([A] * 6, k=4) == [A]


def test_match_near_the_end_returns_fewer_than_k():
    # The worked example of the module doc: (a, b) at 3..4, then only d, a, b remain.
    assert draft([A, B, C, A, B, D, A, B], k=4, max_n=2) == [D, A, B]


@pytest.mark.parametrize(
    ("min_n", "max_n", "k", "vocab"),
    [(1, 4, 4, 3), (2, 3, 5, 4), (1, 1, 3, 6), (3, 5, 2, 2), (1, 6, 8, 5)],
)
def test_incremental_equals_naive_reference_at_every_step(min_n, max_n, k, vocab):
    rng = random.Random(1000 * min_n + 10 * max_n + vocab)
    proposer = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n, num_draft_tokens=k))
    requests = [
        req([rng.randrange(vocab) for _ in range(rng.randrange(0, 12))], rid=f"r{i}")
        for i in range(6)
    ]
    for _ in range(120):
        for r in requests:
            # Speculative steps accept up to k + 1 tokens at once; sometimes none (prefill).
            r.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(0, k + 2)))
        cap = rng.randrange(0, k + 2)
        drafts = proposer.propose(requests, cap)
        for r, d in zip(requests, drafts):
            want = reference(r.all_token_ids, min_n, max_n, min(k, cap))
            assert d.token_ids == want, (r.all_token_ids, d.token_ids, want)
            assert d.parents == list(range(-1, len(want) - 1))


class CountingList(list):
    """A list that counts the elements read through indexing and slicing."""

    reads = 0

    def __getitem__(self, item):
        got = super().__getitem__(item)
        CountingList.reads += len(got) if isinstance(item, slice) else 1
        return got

    def __iter__(self):
        CountingList.reads += len(self)
        return super().__iter__()

    def __add__(self, other):
        CountingList.reads += len(self)
        return list.__add__(self, other)


def test_a_step_reads_only_the_new_tokens_not_the_whole_sequence():
    rng = random.Random(7)
    r = req([rng.randrange(50) for _ in range(3000)])
    r.prompt_token_ids = CountingList(r.prompt_token_ids)
    r.output_token_ids = CountingList([])
    proposer = NgramProposer(NgramConfig())
    proposer.propose([r], 4)
    for _ in range(20):
        r.output_token_ids.append(rng.randrange(50))
        CountingList.reads = 0
        proposer.propose([r], 4)
        # Two O(1) consistency checks and the new token, not O(3000).
        assert CountingList.reads <= 4
        assert proposer.propose([r], 4)[0].token_ids == reference(r.all_token_ids, 1, 4, 4)


TEXT = (
    "the lighthouse keeper climbed the narrow stairs every evening at dusk , trimmed the wick , "
    "polished the great lens until it shone , and wrote the passing ships into a leather log that "
    "his grandmother had started sixty years before"
)
PARAGRAPH = TEXT.split()


def test_drafts_the_rest_of_a_span_the_output_copies_from_the_prompt():
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*PARAGRAPH, "summary", ":", "he"]))}
    word = {i: w for w, i in vocab.items()}
    ids = [vocab[w] for w in PARAGRAPH]
    prompt = ids + [vocab["summary"], vocab[":"]]
    span_start = PARAGRAPH.index("polished")
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=4, num_draft_tokens=5))
    r = req(prompt, [vocab["he"]])
    # The output copies the span "polished the great lens until ..." word by word; after two
    # copied words, every step drafts the next five words of the paragraph exactly.
    for copied in range(1, 12):
        r.output_token_ids = [vocab["he"]] + ids[span_start : span_start + copied]
        (d,) = proposer.propose([r], 5)
        if copied >= 2:
            want = PARAGRAPH[span_start + copied : span_start + copied + 5]
            assert [word[t] for t in d.token_ids] == want


def test_shared_cache_finds_a_continuation_from_a_finished_request():
    config = NgramConfig(min_n=2, max_n=3, num_draft_tokens=3, shared_cache=True)
    proposer = NgramProposer(config)
    first = req([X, A, B, C, D, E], rid="first")
    proposer.propose([first], 3)
    proposer.forget("first")
    assert proposer.num_tracked_requests == 0
    assert proposer.shared_request_ids == ["first"]
    second = req([Y, Z, A, B], rid="second")
    assert proposer.propose([second], 3)[0].token_ids == [C, D, E]
    # Without the shared cache the same request has nothing to draft.
    assert NgramProposer(NgramConfig(min_n=2, max_n=3)).propose([second], 3)[0].token_ids == []
    # The request's own match wins over the shared one.
    own = req([A, B, Y, Z, A, B], rid="own")
    assert proposer.propose([own], 3)[0].token_ids == [Y, Z, A]


def test_shared_cache_is_bounded_and_evicts_least_recently_used_requests():
    config = NgramConfig(min_n=2, max_n=2, shared_cache=True, shared_cache_max_tokens=10)
    proposer = NgramProposer(config)
    for rid, tokens in [("a", [A, B, C, D]), ("b", [B, C, E, X]), ("c", [C, D, Y, Z])]:
        proposer.propose([req(tokens, rid=rid)], 4)
        proposer.forget(rid)
    # 4 + 4 + 4 > 10: "a", the least recently used, is gone, and so are its n-grams.
    assert proposer.shared_request_ids == ["b", "c"]
    assert proposer.num_shared_tokens == 8
    assert proposer.propose([req([Z, A, B])], 4)[0].token_ids == []
    # A hit on "b" makes "c" the least recently used: the next request evicts "c", not "b".
    assert proposer.propose([req([Y, B, C])], 4)[0].token_ids == [E, X]
    proposer.propose([req([C, D, D, E], rid="d")], 4)
    proposer.forget("d")
    assert proposer.shared_request_ids == ["b", "d"]
    assert proposer.propose([req([Z, C, D])], 4)[0].token_ids == [D, E]  # "d"'s, not "c"'s
    # A request longer than the whole budget is not kept.
    proposer.propose([req(list(range(11)), rid="long")], 4)
    proposer.forget("long")
    assert proposer.shared_request_ids == ["b", "d"]
    assert proposer.num_shared_tokens <= 10


def test_forget_drops_state_and_is_idempotent():
    proposer = NgramProposer(NgramConfig())
    proposer.propose([req([A, B, A], rid="x"), req([C, D, C], rid="y")], 4)
    assert proposer.num_tracked_requests == 2
    proposer.forget("x")
    proposer.forget("x")
    proposer.forget("never-seen")
    assert proposer.num_tracked_requests == 1
    assert proposer.shared_request_ids == []  # shared cache off: nothing kept


def test_a_shrunk_or_replaced_request_is_reindexed():
    proposer = NgramProposer(NgramConfig(max_n=2, num_draft_tokens=4))
    r = req([A, B, C, D, A, B, E, X], [A, B], rid="r")
    assert proposer.propose([r], 4)[0].token_ids == [E, X, A, B]
    # Shrunk: a stale index would point (a, b) at 4, past the new end.
    r.output_token_ids = []
    r.prompt_token_ids = [A, B, C, D, A, B]
    assert proposer.propose([r], 4)[0].token_ids == [C, D, A, B]
    # Replaced, longer, with another first token (position 5 still holds b): an index kept from
    # [a b c d a b] would answer [a, b] from (a, b) -> 4; re-indexed, (a, b) -> 3 gives [b, a, b].
    r.prompt_token_ids = [Y, Z, C, A, B, B, A, B]
    assert proposer.propose([r], 4)[0].token_ids == [B, A, B]
    # Same first token, but the last indexed one (position 7) changed: re-indexed again.
    # Kept, the copy would read [... a b x a e] and find no earlier (a, e).
    r.prompt_token_ids = [Y, Z, C, A, B, D, A, E, X, A, E]
    assert proposer.propose([r], 4)[0].token_ids == [X, A, E]


def test_a_preempted_request_that_keeps_its_tokens_keeps_its_index():
    rng = random.Random(3)
    r = req([rng.randrange(20) for _ in range(500)], rid="p")
    proposer = NgramProposer(NgramConfig())
    before = proposer.propose([r], 4)[0].token_ids
    # Preemption frees the KV but keeps the tokens; the output moving into a new list object
    # must not cost a re-index either.
    r.num_computed_tokens, r.block_ids = 0, []
    r.output_token_ids = CountingList(r.output_token_ids)
    r.prompt_token_ids = CountingList(r.prompt_token_ids)
    CountingList.reads = 0
    assert proposer.propose([r], 4)[0].token_ids == before
    assert CountingList.reads <= 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_n": 0}, "min_n=0"),
        ({"min_n": 3, "max_n": 2}, "min_n=3, max_n=2"),
        ({"num_draft_tokens": 0}, "num_draft_tokens=0"),
        ({"shared_cache_max_tokens": 0}, "shared_cache_max_tokens=0"),
    ],
)
def test_config_validation_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramConfig(**kwargs)
