"""The n-gram proposer's storage: every tracked request's tokens in one flat array (`Arena`),
and one open-addressing hash table in NumPy arrays (`Table`) from (request, n, n-gram) hashes to
the latest start of that n-gram, so one NumPy call serves every request of a step. How lookups
stay exact despite hashing is argued in speculative/ngram.py."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np


class Seq:
    """One tracked request: its segment of the arena and the serial its n-gram hashes include
    (a re-indexed request gets a new one, so its old entries are as good as gone)."""

    __slots__ = ("serial", "offset", "capacity", "length", "first", "last")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.offset = self.capacity = self.length = 0
        self.first = self.last = None  # tokens 0 and length-1, for the O(1) consistency check


class Arena:
    """The tracked requests' tokens, a segment each in one flat int64 array, so that one NumPy
    call scatters every request's new tokens and one gathers every request's windows or drafts.

    A segment that fills up moves to the end with twice the room (amortized O(1) per token).
    When the end is reached the live segments are packed into a new array at least twice what
    they hold, so packing too is amortized O(1) per token; forgotten segments die there.
    """

    def __init__(self) -> None:
        self.buf = np.zeros(1 << 12, np.int64)
        self.top = 0  # segments start below it
        self.packs = 0  # how many times the segments moved together

    def reserve(self, seq: Seq, length: int, seqs: Collection[Seq]) -> None:
        """Room for `length` tokens in `seq` (one of `seqs`, the live ones), keeping its first
        seq.length. Other segments may move too: then `packs` counts up."""
        if length <= seq.capacity:
            return
        capacity = max(length, 2 * seq.capacity, 16)
        if self.top + capacity <= len(self.buf):
            self.buf[self.top : self.top + seq.length] = self.buf[
                seq.offset : seq.offset + seq.length
            ]
            seq.offset, seq.capacity = self.top, capacity
            self.top += capacity
            return
        seq.capacity = capacity
        self.packs += 1
        need = sum(s.capacity for s in seqs)
        old, self.buf, self.top = self.buf, np.zeros(max(len(self.buf), 2 * need), np.int64), 0
        for s in seqs:  # a loop over requests, O(live tokens) copied
            self.buf[self.top : self.top + s.length] = old[s.offset : s.offset + s.length]
            s.offset = self.top
            self.top += s.capacity

    def tokens(self, seq: Seq, last: int | None = None) -> list[int]:
        """All of seq's tokens, or its last `last` (fewer if it is shorter)."""
        end = seq.offset + seq.length
        start = seq.offset if last is None else max(seq.offset, end - last)
        return self.buf[start:end].tolist()


SLOTS = 16  # entries per bucket (two cache lines): a probe compares a whole bucket at once


class Table:
    """64-bit key -> int64 value, keeping the largest value put: open addressing in NumPy
    arrays, buckets of SLOTS entries, every item of a call probed at once, one round per bucket
    visited. Key 0 is never stored (`hash_ngrams` sets bit 0) and marks an empty slot.

    Invariant: an entry lives in its home bucket or, if that was full when it came, in a later
    one, with every bucket in between full; buckets fill in slot order and never empty (nothing
    is deleted: the owner builds a new table). So a probe may stop at the first bucket with
    room, and a bucket is full when its last slot is used. At a load of at most 1/2 nearly
    every item stops at its home bucket: a call is one round.

    The home bucket is the key's top bits, so keys sorted by value are sorted by bucket: an
    insert places the items of a bucket in one round, by their rank among them.
    """

    def __init__(self, expected: int = 0) -> None:
        """Room for `expected` keys at a load of at most 1/4."""
        buckets = max(64, 1 << (-(-4 * expected // SLOTS) - 1).bit_length())
        self._shift = np.uint64(64 - (buckets.bit_length() - 1))
        self._mask = buckets - 1
        self.keys = np.zeros(buckets * SLOTS, np.uint64)
        self.vals = np.zeros(buckets * SLOTS, np.int64)
        self._rows = self.keys.reshape(buckets, SLOTS)  # a view: bucket b is row b
        self.size = 0

    def has_room(self, extra: int) -> bool:
        return 2 * (self.size + extra) <= len(self.keys)

    def _probe(self, keys: np.ndarray, bucket: np.ndarray):
        """keys [m] in `bucket` [m] -> (hit [m] bool, slot of each hit [hits], the buckets'
        keys [m, SLOTS]). A key is at most once in a bucket: the first equal slot is it."""
        row = self._rows.take(bucket, axis=0)
        at = bucket * SLOTS + (row == keys[:, None]).argmax(1)
        hit = self.keys.take(at) == keys
        return hit, at[hit], row

    def get(self, keys: np.ndarray) -> np.ndarray:
        """keys [m] -> values [m], -1 where absent."""
        bucket = (keys >> self._shift).astype(np.intp)
        hit, at, row = self._probe(keys, bucket)
        out = np.full(len(keys), -1, np.int64)
        out[hit] = self.vals.take(at)
        more = ~hit & (row[:, -1] != 0)  # missed in a full bucket: go on
        if more.any():
            items = np.flatnonzero(more)
            bucket = bucket[items]
            while items.size:
                bucket = (bucket + 1) & self._mask
                hit, at, row = self._probe(keys[items], bucket)
                out[items[hit]] = self.vals.take(at)
                more = ~hit & (row[:, -1] != 0)
                items, bucket = items[more], bucket[more]
        return out

    def put_max(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """keys, vals [m]; has_room(m) must hold."""
        # 1. One item per key, with its largest value, sorted by key and so by bucket.
        order = np.argsort(keys)
        keys, vals = keys[order], vals[order]
        repeat = keys[1:] == keys[:-1]
        if repeat.any():
            first = np.flatnonzero(np.concatenate([[True], ~repeat]))
            keys, vals = keys[first], np.maximum.reduceat(vals, first)
        bucket = (keys >> self._shift).astype(np.intp)
        while len(keys):
            # 2. Keys there already keep the larger value (keys are unique: so is `at`).
            hit, at, row = self._probe(keys, bucket)
            if len(at):
                self.vals[at] = np.maximum(self.vals.take(at), vals[hit])
                miss = ~hit
                keys, vals, bucket, row = keys[miss], vals[miss], bucket[miss], row[miss]
            # 3. The others take the free slots of their bucket by rank among its items; the
            # rest move on to the next bucket, all together, so `bucket` stays sorted (up to a
            # wrap at the end) and the items of one bucket stay adjacent.
            slot = (row == 0).argmax(1)  # the first free slot (buckets fill in order) ...
            slot[row[:, -1] != 0] = SLOTS  # ... if any
            first = np.ones(len(keys), bool)
            first[1:] = bucket[1:] != bucket[:-1]
            if not first.all():
                i = np.arange(len(keys))
                slot += i - np.maximum.accumulate(np.where(first, i, 0))
            ok = slot < SLOTS
            at = bucket[ok] * SLOTS + slot[ok]
            self.keys[at], self.vals[at] = keys[ok], vals[ok]
            self.size += len(at)
            if len(at) == len(keys):
                return
            keys, vals, bucket = keys[~ok], vals[~ok], (bucket[~ok] + 1) & self._mask


def hash_constants(max_n: int, ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """coef [max_n, nr]: column i sums the last ns[i] window tokens, each times its own odd
    constant; salt [nr]: one constant per n. A fixed seed: runs hash alike."""
    rng = np.random.default_rng(0x6E6772616D)
    odd = (rng.integers(0, 1 << 62, max_n + 1, dtype=np.int64) * 2 + 1).view(np.uint64)
    used = np.arange(max_n)[:, None] >= (max_n - ns)[None, :]
    return np.where(used, odd[:max_n, None], np.uint64(0)), ns.astype(np.uint64) * odd[max_n]


def hash_ngrams(
    window: np.ndarray, serial: np.ndarray, coef: np.ndarray, salt: np.ndarray
) -> np.ndarray:
    """window [Q, max_n] int64 (the n-gram of length n is its last n columns), serial [Q],
    coef [max_n, nr] and salt [nr] (per n) uint64 -> [Q, nr] uint64 hashes of (serial, n,
    n-gram), never 0: a sum of products mod 2**64, then times an odd constant, whose top bits
    (the bucket) depend on every bit below."""
    h = window.view(np.uint64) @ coef  # [Q, nr]
    h += (serial.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15))[:, None] + salt
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h |= np.uint64(1)
    return h
