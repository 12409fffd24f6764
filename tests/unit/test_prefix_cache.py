"""PrefixCache: chained digests, longest-prefix match, the digest map and LRU eviction order."""

from __future__ import annotations

import pytest

from outrider.engine.prefix_cache import DIGEST_SIZE, ROOT_DIGEST, PrefixCache, hash_block

BS = 4


def chain(token_ids: list[int], block_size: int = BS) -> list[bytes]:
    digests, parent = [], ROOT_DIGEST
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        digests.append(parent)
    return digests


def test_hash_block_is_deterministic_and_covers_parent_and_order():
    d = hash_block(ROOT_DIGEST, [1, 2, 3, 4])
    assert len(d) == DIGEST_SIZE
    assert d == hash_block(ROOT_DIGEST, (1, 2, 3, 4))
    assert d != hash_block(ROOT_DIGEST, [4, 3, 2, 1])
    # Same block content under different parents: different prefixes, different digests.
    assert hash_block(d, [5, 6, 7, 8]) != hash_block(ROOT_DIGEST, [5, 6, 7, 8])
    # Ids beyond 32 bits are kept whole, not truncated.
    assert hash_block(ROOT_DIGEST, [2**32 + 1]) != hash_block(ROOT_DIGEST, [1])


def test_match_returns_longest_cached_chain_and_stops_at_first_miss():
    cache = PrefixCache(BS)
    tokens = list(range(16))
    d = chain(tokens)
    cache.insert(d[0], 10)
    cache.insert(d[1], 11)
    cache.insert(d[3], 13)  # block 2 missing: block 3 must be unreachable
    blocks, digests = cache.match(tokens, max_blocks=4)
    assert blocks == [10, 11]
    assert digests == d[:2]
    assert cache.match(tokens, max_blocks=1) == ([10], d[:1])
    # A different first block shares nothing, even with identical later blocks.
    other = [99, 1, 2, 3] + tokens[4:]
    assert cache.match(other, max_blocks=4) == ([], [])


def test_match_never_uses_a_partial_block():
    cache = PrefixCache(BS)
    tokens = list(range(8))
    for i, digest in enumerate(chain(tokens)):
        cache.insert(digest, i)
    assert cache.match(tokens[:7], max_blocks=10)[0] == [0]


def test_insert_keeps_first_block_for_a_digest():
    cache = PrefixCache(BS)
    d = chain([1, 2, 3, 4])[0]
    assert cache.insert(d, 5)
    assert not cache.insert(d, 6)
    assert cache.lookup(d) == 5
    assert not cache.is_cached(6)
    # One block under two digests would mean a cached block was rewritten.
    with pytest.raises(RuntimeError, match="block 5 is already cached"):
        cache.insert(chain([9, 9, 9, 9])[0], 5)
    cache.check_invariants()


def test_evict_is_lru_by_release_and_drops_the_digest():
    cache = PrefixCache(BS)
    digests = {b: chain([b] * BS)[0] for b in range(3)}
    for b, d in digests.items():
        cache.insert(d, b)
    for b in (2, 0, 1):
        cache.release(b)
    cache.acquire(0)  # a hit revives block 0: it leaves the evictable set
    assert cache.num_evictable == 2
    assert cache.evict() == 2
    assert cache.lookup(digests[2]) is None
    assert not cache.is_cached(2)
    assert cache.evict() == 1
    with pytest.raises(KeyError):
        cache.evict()  # block 0 is held, so nothing is evictable
    assert cache.lookup(digests[0]) == 0
    cache.release(0)
    assert cache.evict() == 0
    assert cache.num_cached == 0
    cache.check_invariants()
