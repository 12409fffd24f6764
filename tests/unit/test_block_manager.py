"""BlockManager: allocation, reference counts, prefix reuse, eviction, rollback."""

from __future__ import annotations

import random

import pytest

from outrider.core import Request, SamplingParams
from outrider.engine.block_manager import BlockManager

BS = 4


def make_req(tokens: list[int]) -> Request:
    return Request(prompt_token_ids=list(tokens), params=SamplingParams())


def compute(bm: BlockManager, req: Request, n: int | None = None) -> None:
    """What a step does to one request: allocate, "compute" n tokens, commit."""
    n = req.num_tokens - req.num_computed_tokens if n is None else n
    assert bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.commit(req)


def test_allocate_then_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    req = make_req(list(range(9)))
    assert bm.num_blocks_needed(req, 9) == 3
    assert bm.allocate(req, 9)
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert bm.num_free_blocks == 7
    assert bm.num_blocks_needed(req, 3) == 0  # positions 0..11 still fit in 3 blocks
    req.num_computed_tokens = 9
    assert bm.num_blocks_needed(req, 4) == 1
    bm.free(req)
    assert req.block_ids == []
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_req(list(range(8))), make_req(list(range(100, 112)))
    assert bm.allocate(a, 8)
    before = (list(a.block_ids), bm.num_free_blocks, [bm.ref_count(i) for i in range(4)])
    assert not bm.allocate(b, 12)  # needs 3, 2 free
    assert b.block_ids == []
    assert (list(a.block_ids), bm.num_free_blocks, [bm.ref_count(i) for i in range(4)]) == before
    assert bm.allocate(b, 8)
    bm.check_invariants()


def test_shared_prefix_takes_references_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    a = make_req(prompt)
    assert bm.match_prefix(a) == 0
    compute(bm, a)
    b = make_req(prompt + [50, 51])
    assert bm.match_prefix(b) == 8
    assert b.num_computed_tokens == 8
    assert b.block_ids == a.block_ids[:2]
    assert [bm.ref_count(x) for x in a.block_ids] == [2, 2, 1]
    assert bm.stats.queried_tokens == 10 + 12
    assert bm.stats.hit_tokens == 8
    compute(bm, b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_ids] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(8))  # exactly two full blocks
    a = make_req(prompt)
    bm.match_prefix(a)
    compute(bm, a)
    b = make_req(prompt)
    assert bm.match_prefix(b) == 4  # only block 0: token 7's logits must be computed
    assert b.block_ids == a.block_ids[:1]
    assert bm.allocate(b, 4)
    assert b.block_ids[1] != a.block_ids[1]  # the recomputed block is private


def test_eviction_is_lru_and_evicted_prefixes_stop_hitting():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old, new = make_req([1] * 5), make_req([2] * 5)  # one full block each (+1 partial)
    for req in (old, new):
        bm.match_prefix(req)
        compute(bm, req)
    old_block, new_block = old.block_ids[0], new.block_ids[0]
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.cache.num_cached == 2
    # Plain free blocks go first: two blocks leave both cached prefixes alone.
    filler = make_req([9] * 8)
    assert bm.allocate(filler, 8)
    assert old_block not in filler.block_ids and new_block not in filler.block_ids
    # The third block must evict, and the least recently released one goes.
    assert bm.allocate(filler, 12)
    assert filler.block_ids[2] == old_block
    assert bm.stats.evicted_blocks == 1
    assert bm.match_prefix(make_req([1] * 5)) == 0
    assert bm.match_prefix(make_req([2] * 5)) == 4
    bm.check_invariants()


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = list(range(13))  # 3 full blocks cached (+1 token that is never computed here)
    a = make_req(prompt)
    bm.match_prefix(a)
    compute(bm, a, 12)
    head, _, tail = a.block_ids
    bm.free(a)
    b = make_req([77] * 4)
    assert bm.allocate(b, 4)
    assert b.block_ids == [tail]
    c = make_req(prompt)
    assert bm.match_prefix(c) == 8  # the head of the chain survived
    assert c.block_ids[0] == head


def test_trim_frees_the_blocks_past_the_kept_positions():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_req(list(range(6)))
    bm.match_prefix(req)
    assert bm.allocate(req, 6 + 5)  # 6 prompt + 5 draft slots -> 3 blocks
    req.num_computed_tokens = 11
    kept, dropped = req.block_ids[:2], req.block_ids[2]
    bm.trim(req, 7)  # 1 draft accepted: positions 0..6 stay
    assert req.block_ids == kept
    assert req.num_computed_tokens == 7
    assert bm.ref_count(dropped) == 0 and bm.num_free_blocks == 6
    bm.trim(req, 8)  # nothing to drop
    assert req.block_ids == kept
    bm.check_invariants()


def test_trim_refuses_to_cut_into_a_committed_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_req(list(range(10)))
    bm.match_prefix(req)
    compute(bm, req)  # blocks 0 and 1 committed
    with pytest.raises(ValueError, match="cut into block 1"):
        bm.trim(req, 6)
    assert len(req.block_ids) == 3 and req.num_computed_tokens == 10
    bm.trim(req, 4)  # dropping whole committed blocks is safe
    assert len(req.block_ids) == 1
    bm.free(req)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_trim_whole_committed_blocks_then_recompute_caches_the_new_content():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_req([1, 2, 3, 4])
    req.output_token_ids = [5, 6, 7, 8, 9, 10, 11, 12]
    bm.match_prefix(req)
    compute(bm, req)  # 3 full blocks committed
    bm.trim(req, 4)
    req.output_token_ids = [20, 21, 22, 23, 24, 25, 26, 27]  # different tokens after the cut
    compute(bm, req)
    probe = make_req(req.all_token_ids + [0])
    assert bm.match_prefix(probe) == 12
    assert probe.block_ids == req.block_ids


def test_double_free_and_misuse_raise():
    bm = BlockManager(num_blocks=4, block_size=BS)
    req = make_req(list(range(5)))
    bm.match_prefix(req)
    with pytest.raises(ValueError, match="only for a waiting request"):
        bm.match_prefix(req)
    assert bm.allocate(req, 5)
    bm.free(req)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(req)
    assert bm.num_free_blocks == 4
    # Two requests sharing one block list: the second release finds a count of 0.
    a, b = make_req([1]), make_req([1])
    assert bm.allocate(a, 1)
    bm.allocate(b, 0)
    b.block_ids = list(a.block_ids)
    bm.free(a)
    with pytest.raises(RuntimeError, match="reference count 0"):
        bm.free(b)


def test_commit_rejects_more_computed_than_known_tokens():
    bm = BlockManager(num_blocks=4, block_size=BS)
    req = make_req(list(range(4)))
    assert bm.allocate(req, 8)
    req.num_computed_tokens = 8  # 4 draft slots still in place
    with pytest.raises(ValueError, match="trim rejected draft slots"):
        bm.commit(req)


def test_same_block_computed_twice_stays_private_and_chain_continues():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))
    a, b = make_req(prompt), make_req(prompt)
    bm.match_prefix(a)
    bm.match_prefix(b)  # both miss: admitted in the same step
    compute(bm, a)
    compute(bm, b)
    assert all(not bm.cache.is_cached(x) for x in b.block_ids)
    c = make_req(prompt + [1, 2, 3, 4])
    assert bm.match_prefix(c) == 12
    assert c.block_ids == a.block_ids[:3]
    for req in (a, b, c):
        bm.free(req)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_req(list(range(9)))
    bm.match_prefix(a)
    compute(bm, a)
    b = make_req(list(range(9)))
    assert bm.match_prefix(b) == 0
    assert bm.cache.num_cached == 0 and bm.stats.queried_tokens == 0


def test_randomized_shared_prefixes_keep_invariants():
    rng = random.Random(0)
    num_blocks = 24
    bm = BlockManager(num_blocks=num_blocks, block_size=BS)
    kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token whose KV was written there

    def write(req: Request, n: int) -> None:
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            block = req.block_ids[pos // BS]
            assert not bm.cache.is_cached(block), f"write into cached block {block}"
            kv[block, pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += n
        bm.commit(req)

    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    live: list[Request] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.3 or not live:
            stem = rng.choice(stems)
            req = make_req(stem + [rng.randrange(50) for _ in range(rng.randrange(0, 10))])
            hit = bm.match_prefix(req)
            assert hit % BS == 0 and hit <= req.num_tokens - 1
            # A hit block holds exactly this request's tokens at those positions.
            for pos in range(hit):
                assert kv[req.block_ids[pos // BS], pos % BS] == req.all_token_ids[pos]
            n = req.num_tokens - req.num_computed_tokens
            if bm.allocate(req, n):
                write(req, n)
                live.append(req)
            else:
                bm.free(req)
        elif op < 0.7:
            req = rng.choice(live)
            req.output_token_ids.append(rng.randrange(50))  # one decode step
            if bm.allocate(req, 1):
                write(req, 1)
            else:
                live.remove(req)
                bm.free(req)
        else:
            req = live.pop(rng.randrange(len(live)))
            bm.free(req)
        bm.check_invariants()
        refs = [0] * num_blocks
        for req in live:
            for b in req.block_ids:
                refs[b] += 1
            assert len(req.block_ids) * BS >= req.num_computed_tokens
        assert refs == [bm.ref_count(b) for b in range(num_blocks)], f"step {step}"
        assert bm.num_free_blocks == sum(r == 0 for r in refs)
    for req in live:
        bm.free(req)
    assert bm.num_free_blocks == num_blocks
    assert bm.stats.hit_tokens > 0 and bm.stats.evicted_blocks > 0
    bm.check_invariants()
