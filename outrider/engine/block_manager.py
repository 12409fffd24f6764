"""Paged KV blocks: who holds which block, which are free, which full blocks can be reused.

Block i of a request holds positions [i * block_size, (i + 1) * block_size). With block_size 4
and 10 computed tokens a request holds 3 blocks, the last one partial:

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    block_ids  [  7    ,   2     ,   5   ]        blocks 7 and 2 are full and may be cached

Every block is in exactly one of three states:
  - held:      reference count >= 1 (two requests sharing a cached prefix both hold it);
  - free:      reference count 0 and not cached, in `_free`;
  - evictable: reference count 0 but still cached (its request finished or was preempted), in
               the prefix cache's LRU order; a later request with the same prefix can revive it.
Allocation takes free blocks first and evicts the least recently released cached block only
when none is left, so cached prefixes live as long as memory allows.
"""

from __future__ import annotations

from collections import deque

from outrider.core import Request
from outrider.engine.prefix_cache import ROOT_DIGEST, PrefixCache, PrefixCacheStats, hash_block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"invalid num_blocks={num_blocks}: use an integer >= 1")
        if block_size < 1:
            raise ValueError(f"invalid block_size={block_size}: use an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache = PrefixCache(block_size)
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Per request holding blocks: the digests of its leading full, computed blocks, so commit
        # extends the chain without rehashing the whole prefix. Also the record of who holds
        # blocks, which is how a double free is caught.
        self._digests: dict[str, list[bytes]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + self.cache.num_evictable

    def tracks(self, req: Request) -> bool:
        """True from match_prefix or allocate until free, even while the request has 0 blocks."""
        return req.request_id in self._digests

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add so `block_ids` covers positions [0, num_computed_tokens + num_new)."""
        total = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(req.block_ids))

    def match_prefix(self, req: Request) -> int:
        """Start a fresh request on its longest cached prefix: take a reference on each hit
        block, set `block_ids` and `num_computed_tokens`, and return the cached token count.

        Hits stop at the last full block ending at or before num_tokens - 1: at least the last
        token must be computed for its logits, and it must land in a block of its own, never in
        a shared one. Prompt of 8 tokens, block_size 4: (8 - 1) // 4 = 1 block may hit, and
        tokens 4..7 are recomputed into a private block.
        """
        if self.tracks(req) or req.block_ids or req.num_computed_tokens:
            raise ValueError(
                f"match_prefix on request {req.request_id} that already has "
                f"{req.num_computed_tokens} computed tokens and blocks {req.block_ids}: "
                "it is only for a waiting request's first schedule (free it first)"
            )
        self._digests[req.request_id] = []
        if not self.enable_prefix_caching:
            return 0
        token_ids = req.all_token_ids
        blocks, digests = self.cache.match(token_ids, (len(token_ids) - 1) // self.block_size)
        for block_id in blocks:
            if self._ref[block_id] == 0:
                self.cache.acquire(block_id)
            self._ref[block_id] += 1
        num_cached = len(blocks) * self.block_size
        req.block_ids = blocks
        req.num_computed_tokens = num_cached
        self._digests[req.request_id] = digests
        # A request that cannot be admitted is unmatched and looked up again later, and counted
        # again: the rate stays exact for admitted work but weighs retried requests more.
        self.stats.num_queries += 1
        self.stats.queried_tokens += len(token_ids)
        self.stats.hit_tokens += num_cached
        return num_cached

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow `block_ids` to cover num_computed_tokens + num_new_tokens positions. All or
        nothing: returns False and changes nothing when the pool is short."""
        if not self.tracks(req) and req.block_ids:
            raise ValueError(
                f"request {req.request_id} has blocks {req.block_ids} this manager never gave it"
            )
        needed = self.num_blocks_needed(req, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        self._digests.setdefault(req.request_id, [])
        for _ in range(needed):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id = self.cache.evict()
                self.stats.evicted_blocks += 1
            assert self._ref[block_id] == 0, f"block {block_id} allocated while held"
            self._ref[block_id] = 1
            req.block_ids.append(block_id)
        return True

    def commit(self, req: Request) -> None:
        """Cache every block that became full and computed since the last commit.

        Trusts `num_computed_tokens`: positions below it must hold the KV of `all_token_ids` at
        those positions, so speculative slots must be rolled back (trim) before committing.
        """
        if not self.enable_prefix_caching:
            return
        if req.num_computed_tokens > req.num_tokens:
            raise ValueError(
                f"commit of request {req.request_id} with {req.num_computed_tokens} computed but "
                f"only {req.num_tokens} known tokens: trim rejected draft slots before commit"
            )
        digests = self._digests[req.request_id]
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= len(digests):
            return  # most decode steps end here, without building all_token_ids
        assert num_full <= len(req.block_ids), (
            f"request {req.request_id}: {req.num_computed_tokens} computed tokens need "
            f"{num_full} full blocks but it holds {len(req.block_ids)}"
        )
        token_ids = req.all_token_ids
        bs = self.block_size
        parent = digests[-1] if digests else ROOT_DIGEST
        for i in range(len(digests), num_full):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            # False when another request computed the same block first: ours stays private and
            # returns to the free list when released. The chain continues on the digest anyway.
            self.cache.insert(parent, req.block_ids[i])
            digests.append(parent)

    def free(self, req: Request) -> None:
        """Drop all of the request's references. Tail blocks are released first so they are
        evicted first: the chain's head, which every longer prefix needs, survives longest."""
        if not self.tracks(req):
            raise ValueError(
                f"free of request {req.request_id} that holds no blocks (freed twice?); "
                f"its block_ids are {req.block_ids}"
            )
        for block_id in reversed(req.block_ids):
            self._release(block_id)
        req.block_ids = []
        del self._digests[req.request_id]

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks covering positions [0, num_tokens) and free the rest (rejected
        draft slots); lowers num_computed_tokens to at most num_tokens.

        block_size 4, blocks [7, 2, 5], 3 drafts rejected leaving num_tokens 6:
            positions 0 1 2 3 | 4 5 x x | x x . .    keep cdiv(6, 4) = 2 blocks, free block 5
        Cutting into a block that is already cached (a committed block) is refused: the next
        write would change KV that other requests may read.
        """
        if num_tokens < 0:
            raise ValueError(f"invalid num_tokens={num_tokens} for trim: use an integer >= 0")
        if not self.tracks(req):
            raise ValueError(f"trim of request {req.request_id} that holds no blocks")
        keep = cdiv(num_tokens, self.block_size)
        digests = self._digests[req.request_id]
        num_full_kept = num_tokens // self.block_size
        if len(digests) > num_full_kept and num_tokens % self.block_size:
            raise ValueError(
                f"trim of request {req.request_id} to {num_tokens} tokens would cut into block "
                f"{num_full_kept}, which is committed ({len(digests)} full blocks cached); "
                "only uncommitted (draft) slots can be rolled back"
            )
        for block_id in reversed(req.block_ids[keep:]):
            self._release(block_id)
        del req.block_ids[keep:]
        del digests[num_full_kept:]
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens)

    def _release(self, block_id: int) -> None:
        if self._ref[block_id] <= 0:
            raise RuntimeError(
                f"block {block_id} released with reference count {self._ref[block_id]}: "
                "two requests share one block_ids list, or a request was freed twice"
            )
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            if self.cache.is_cached(block_id):
                self.cache.release(block_id)
            else:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def check_invariants(self) -> None:
        """Every block is exactly one of held / free / evictable (O(num_blocks); for tests)."""
        self.cache.check_invariants()
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, ref in enumerate(self._ref):
            assert ref >= 0, f"block {block_id} has reference count {ref}"
            states = (ref > 0, block_id in free, self.cache.is_evictable(block_id))
            assert sum(states) == 1, f"block {block_id} (held, free, evictable) = {states}"
            if block_id in free:
                assert not self.cache.is_cached(block_id), f"free block {block_id} is cached"
