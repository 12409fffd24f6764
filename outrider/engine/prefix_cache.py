"""Hash-chained prefix cache: which KV block already holds a given full block of tokens.

A block's digest covers its own token ids *and* its parent's digest, so equal digests mean equal
whole prefixes, not just equal blocks:

    tokens  [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9]      block_size 4
    digest  d0 = H(ROOT, t0..t3)
            d1 = H(d0,   t4..t7)                     the last, partial block is never hashed

The digest is a cryptographic hash (blake2b, 256 bits). Python's `hash()` would be faster but
collides on purpose-built or merely unlucky inputs, and a collision here silently serves one
prompt's KV to another; at 256 bits a collision is not a practical concern.

Boundary with `BlockManager`: this file owns hashing, the digest <-> block map and the LRU order
of *evictable* cached blocks; the block manager owns reference counts and the plain free list,
and tells this cache about every reference count change to or from zero (`release`/`acquire`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_DIGEST = b""  # the parent of block 0
DIGEST_SIZE = 32


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest of one full block given its parent's digest (`ROOT_DIGEST` for block 0)."""
    ids = array("q", token_ids)
    # Little-endian on every machine, so a digest means the same thing wherever it is computed
    # (a future disk or cross-host KV cache can key on it).
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(ids.tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counters since start. `queried_tokens` counts every prompt token looked up (one lookup per
    admission attempt), `hit_tokens` those served from the cache."""

    num_queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """digest <-> block id for full, computed blocks, plus the LRU order of evictable ones.

    Invariants (the block manager keeps the last two by calling `acquire`/`release` on every
    reference count change between 0 and 1 of a cached block):
      - the map is a bijection: a digest names at most one block, a block carries at most one
        digest (a second block computed with the same content stays uncached);
      - evictable blocks are cached blocks with reference count 0, kept oldest release first;
      - a cached block is full and its KV is final: nobody writes to it while it is cached.
    Evicting a block drops its digest, so it can no longer be hit; its descendants' digests stay
    mapped but are unreachable (a lookup walks from the root and stops at the first miss) until
    they are evicted in turn.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"invalid block_size={block_size}: use an integer >= 1")
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        # Insertion order is LRU order: the first key is released longest ago. An OrderedDict and
        # not a deque because a hit takes a block out of the middle, which must be O(1).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._digest_of

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def match(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[bytes]]:
        """The longest cached chain of full blocks of `token_ids`, at most `max_blocks` long:
        (block ids, their digests). Takes no references; the caller does."""
        bs = self.block_size
        max_blocks = min(max_blocks, len(token_ids) // bs)
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = ROOT_DIGEST
        for i in range(max_blocks):
            digest = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self._block_of.get(digest)
            if block_id is None:
                break
            blocks.append(block_id)
            digests.append(digest)
            parent = digest
        return blocks, digests

    def insert(self, digest: bytes, block_id: int) -> bool:
        """Cache a block the caller holds (reference count >= 1). Returns False, and caches
        nothing, when the digest already names a block (the same content computed twice)."""
        if digest in self._block_of:
            return False
        if block_id in self._digest_of:
            raise RuntimeError(
                f"block {block_id} is already cached under another digest; a cached block must "
                "never be written, so reaching here means a shared block was reused as a tail"
            )
        self._block_of[digest] = block_id
        self._digest_of[block_id] = digest
        return True

    def release(self, block_id: int) -> None:
        """A cached block's reference count fell to 0: it becomes the most recently used
        evictable block."""
        assert block_id in self._digest_of, f"block {block_id} is not cached"
        assert block_id not in self._evictable, f"block {block_id} released twice"
        self._evictable[block_id] = None

    def acquire(self, block_id: int) -> None:
        """A prefix hit took a reference on an evictable block: it may not be evicted now."""
        del self._evictable[block_id]

    def evict(self) -> int:
        """Drop the least recently released evictable block from the cache and return its id
        (now an ordinary free block). Raises KeyError when nothing is evictable."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._digest_of.pop(block_id)]
        return block_id

    def check_invariants(self) -> None:
        assert len(self._block_of) == len(self._digest_of), "digest map is not a bijection"
        for digest, block_id in self._block_of.items():
            assert self._digest_of.get(block_id) == digest, f"block {block_id} maps back wrongly"
        for block_id in self._evictable:
            assert block_id in self._digest_of, f"evictable block {block_id} is not cached"
