"""NgramProposer: exact drafts on hand-made sequences, incremental == a naive reference at every
step, copying from the prompt, the shared cache, forget/shrink handling and config validation;
random scenarios (growth, forgetting, re-adding, re-indexing, the shared cache, forced hash
collisions and crowded buckets) against a copy of the dict-per-request proposer it replaced."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

import outrider.speculative.ngram as ngram
from outrider.core import Request, SamplingParams
from outrider.speculative.base import Proposer, SeqDrafts
from outrider.speculative.ngram import NgramConfig, NgramProposer
from outrider.speculative.ngram_index import Table

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


class DictNgram:
    """The dict-per-request proposer the vectorized one replaced (outrider 5f66075), compact:
    per request its tokens and n-gram -> latest start with a follower; a shared cache of
    finished requests, n-gram -> (request, start), LRU, evicted whole."""

    def __init__(self, c: NgramConfig) -> None:
        self.c, self.seqs = c, {}
        self.kept, self.where, self.num_shared = OrderedDict(), {}, 0

    def _index(self, tokens: list, index: dict, start: int) -> None:
        for n in range(self.c.min_n, self.c.max_n + 1):
            for s in range(max(0, start - n), len(tokens) - n):
                index[tuple(tokens[s : s + n])] = s

    def propose(self, requests, cap: int) -> list[list[int]]:
        k, out = min(self.c.num_draft_tokens, cap), []
        for r in requests:
            if k == 0:
                out.append([])
                continue
            now = r.prompt_token_ids + r.output_token_ids
            seq = self.seqs.get(r.request_id)
            if seq is None or (
                seq[0]
                and (
                    len(now) < len(seq[0])
                    or now[0] != seq[0][0]
                    or now[len(seq[0]) - 1] != seq[0][-1]
                )
            ):
                seq = self.seqs[r.request_id] = ([], {})
            tokens, index = seq
            start = len(tokens)
            tokens.extend(now[start:])
            self._index(tokens, index, start)
            drafts, end = [], len(tokens)
            for n in range(min(self.c.max_n, end - 1), self.c.min_n - 1, -1):
                s = index.get(tuple(tokens[end - n :]))
                if s is not None:
                    drafts = tokens[s + n : s + n + k]
                    break
            if not drafts and self.c.shared_cache:
                for n in range(min(self.c.max_n, end), self.c.min_n - 1, -1):
                    hit = self.where.get(tuple(tokens[end - n :]))
                    if hit is not None:
                        self.kept.move_to_end(hit[0])
                        drafts = self.kept[hit[0]][0][hit[1] + n : hit[1] + n + k]
                        break
            out.append(drafts)
        return out

    def forget(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is None or not self.c.shared_cache:
            return
        if rid in self.kept:
            self._remove(rid)
        if len(seq[0]) > self.c.shared_cache_max_tokens or not seq[1]:
            return
        while self.num_shared + len(seq[0]) > self.c.shared_cache_max_tokens:
            self._remove(next(iter(self.kept)))
        self.kept[rid] = seq
        self.num_shared += len(seq[0])
        self.where.update((key, (rid, s)) for key, s in seq[1].items())

    def _remove(self, rid: str) -> None:
        tokens, index = self.kept.pop(rid)
        self.num_shared -= len(tokens)
        for key in index:
            if self.where.get(key, ("",))[0] == rid:
                del self.where[key]


def run_scenario(seed: int, steps: int = 40) -> None:
    """Random requests against both proposers: new ones (0..300 tokens), growth by 0..k+1 tokens
    or a chunk, forgetting and re-adding an id, shrinking or replacing tokens, an id twice in
    one call, caps 0..k+1; drafts and the shared cache's state must agree after every call."""
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    config = NgramConfig(
        min_n=min_n,
        max_n=min_n + rng.randint(0, 3),
        num_draft_tokens=rng.randint(1, 6),
        shared_cache=rng.random() < 0.4,
        shared_cache_max_tokens=rng.choice([8, 60, 400, 1 << 16]),
    )
    vocab, k = rng.randint(1, 6), config.num_draft_tokens
    new, old = NgramProposer(config), DictNgram(config)
    live: dict[str, Request] = {}

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    for _ in range(steps):
        while len(live) < 2 or rng.random() < 0.15:
            rid = f"r{rng.randrange(12)}"  # ids come back after being forgotten
            live[rid] = req(tokens(rng.choice([0, 1, 2, rng.randint(0, 300)])), rid=rid)
        for r in live.values():
            grow = rng.randint(0, k + 1) if rng.random() < 0.9 else rng.randint(0, 80)
            r.output_token_ids += tokens(grow)
        if rng.random() < 0.05:  # shrunk or replaced: both re-index
            r = rng.choice(list(live.values()))
            r.prompt_token_ids = tokens(len(r.prompt_token_ids) // 2 + rng.randint(0, 3))
        batch = rng.sample(list(live.values()), rng.randint(1, len(live)))
        if rng.random() < 0.1:
            batch.append(batch[0])
        cap = rng.randint(0, k + 1)
        got = [d.token_ids for d in new.propose(batch, cap)]
        assert got == old.propose(batch, cap), (seed, [r.all_token_ids for r in batch])
        assert new.num_tracked_requests == len(old.seqs)
        assert new.shared_request_ids == list(old.kept)
        assert new.num_shared_tokens == old.num_shared
        for rid in list(live):
            if rng.random() < 0.08:
                new.forget(rid)
                old.forget(rid)
                del live[rid]
        new.forget("never-seen")


@pytest.mark.parametrize("seeds", [range(0, 40), range(40, 80)])
def test_random_scenarios_give_the_dict_proposers_drafts(seeds):
    for seed in seeds:
        run_scenario(seed)


def weak_hashes(kind: str):
    real = ngram.hash_ngrams

    def hashes(window, serial, coef, salt):
        h = real(window, serial, coef, salt)
        if kind == "collide":  # 4 distinct keys: most lookups find another n-gram's entry
            return (h & np.uint64(6)) | np.uint64(1)
        return h | np.uint64(0xFFF << 52)  # every key in the last buckets: long chains, a wrap

    return hashes


@pytest.mark.parametrize("kind", ["collide", "crowd"])
def test_hash_collisions_and_crowded_buckets_keep_drafts_exact(kind, monkeypatch):
    monkeypatch.setattr(ngram, "hash_ngrams", weak_hashes(kind))
    for seed in range(100, 112):
        run_scenario(seed, steps=25)


def test_table_keeps_the_largest_value_per_key():
    rng = np.random.default_rng(0)
    table, want = Table(expected=3000), {}
    for _ in range(40):
        m = int(rng.integers(0, 150))
        # Few distinct keys (repeats within and across calls), half of them crowded into the
        # last buckets so that probes run on and wrap around.
        keys = rng.integers(1, 400, m).astype(np.uint64)
        keys[rng.random(m) < 0.5] |= np.uint64(0xFFFF << 48)
        vals = rng.integers(0, 10**6, m)
        assert table.has_room(m)
        table.put_max(keys, vals)
        for key, val in zip(keys.tolist(), vals.tolist()):
            want[key] = max(want.get(key, -1), val)
        probe = np.concatenate(
            [np.array(list(want), np.uint64), rng.integers(1, 400, 50).astype(np.uint64)]
        )
        assert table.get(probe).tolist() == [want.get(key, -1) for key in probe.tolist()]
    assert table.size == len(want)


def test_the_same_request_twice_in_one_call_is_one_after_another():
    proposer = NgramProposer(NgramConfig(max_n=2))
    a, b = req([A, B, C, A], rid="x"), req([A, B, C, A, B, C, D, A, B], rid="x")
    # The second copy extends the first: its lookup must see the first's catch-up.
    got = [d.token_ids for d in proposer.propose([a, b, a], 4)]
    assert got == [[B, C, A], [C, D, A, B], [B, C, A]]


def test_a_full_table_is_rebuilt_without_forgotten_requests():
    rng = random.Random(5)
    proposer = NgramProposer(NgramConfig())
    for i in range(6):
        proposer.propose([req([rng.randrange(50) for _ in range(400)], rid=f"r{i}")], 4)
        proposer.forget(f"r{i}")
    r = req([rng.randrange(50) for _ in range(400)], rid="last")
    assert proposer.propose([r], 4)[0].token_ids == reference(r.all_token_ids, 1, 4, 4)
    # Rebuilt for the live request alone: 399 positions x 4 n at most.
    assert proposer._table.size <= 399 * 4
