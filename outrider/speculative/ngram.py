"""Prompt-and-output lookup proposer (vLLM/SGLang "ngram", HF "prompt lookup decoding").

The last n tokens of a sequence are looked up in the sequence itself; if they occurred before,
the tokens that followed that occurrence are the drafts. The longest n in [min_n, max_n] with a
match wins; among occurrences of that n the most recent wins.

Every n-gram of a request *that has a follower* (it ends at or before position L-2) is indexed,
n-gram -> start of its latest such occurrence. The suffix itself ends at L-1, so it is never in
the index: any hit is an earlier occurrence.

    tokens   a  b  c  a  b  d  a  b       L = 8, min_n 1, max_n 2, k 4
    pos      0  1  2  3  4  5  6  7
    index    (a,b)->3  (b,c)->1  (c,a)->2  (b,d)->4  (d,a)->5         n = 2
             (a)->6  (b)->4  (c)->2  (d)->5                            n = 1
    lookup   n=2: suffix (a,b) = pos 6..7; the index says start 3, so the drafts are
             tokens[3+2 : 3+2+4] = tokens[5:9] = [d, a, b]: only 3, the sequence ends at 7.
    append c at pos 8: the n-grams ending at pos 7 gain a follower: (b)->7, (a,b)->6.

Drafts may run into the suffix itself (a repeating pattern: "a b a b a", n=2, suffix (b,a) at
3..4 matches start 1, drafts tokens[3:5] = [b, a]) but never past the end of the sequence.

Why the most recent occurrence (vLLM v1's KMP scan and HF's prompt lookup keep the earliest):
recent context is what a model is usually copying from (the latest version of an edited code
block, the latest turn of a conversation, the current iteration of a loop), and an index that
keeps the largest start gets that for free. The cost: in a loop whose period d is shorter than
k, the most recent occurrence is d tokens back, so its continuation is cut at the sequence end
after d tokens where the earliest occurrence would give k.

A call is batched over its requests: O(requests) Python work and a fixed number of NumPy calls
(about 60 in a decode step) on arrays of (new tokens + 1) * requests * (max_n - min_n + 1)
elements; no Python loop over tokens and no scan of a sequence:
1. the requests' new tokens go into their segments of one flat token array (`Arena`), one
   scatter;
2. one gather cuts a window of max_n tokens ending at each position that matters, those just
   before the new tokens (their n-grams just gained a follower) and each request's last one
   (the suffixes), and one small matmul hashes every n-gram of every window with its request's
   serial and n to 64 bits (`hash_ngrams`);
3. `Table.put_max` indexes the former (hash -> start, keeping the largest start), then
   `Table.get` looks the suffixes up, every n at once;
4. per request the longest n that hit gives the start; one gather reads both the n-gram at
   that start and the drafts after it.

Exact despite hashing: an entry holds the largest start of all n-grams put with its hash. A
hit is taken when the n-gram at its start is the suffix and has a follower: then it is the
latest occurrence s*, since s* was put with the same hash (so the start is >= s*) and the start
is an occurrence itself (so it is <= s*). A miss means nothing with that hash was put, so the
suffix has no earlier occurrence. Otherwise (two n-grams sharing a 64-bit hash: about never;
the tests force it) the request is answered by an exact NumPy scan of its tokens (`_scan`).

Cost (benchmarks/ngram_lookup.py, 2-core x86 VM, Python 3.11, NumPy 2.4): a decode step of 64
requests appending one token each takes ~330 us at 1,000, 4,000 or 16,000 tokens, ~5 us per
request of which about half is the per-request Python that reads the request and builds its
SeqDrafts (the dict-per-request version this replaced: ~390, ~420 and ~425 us). Indexing a
prompt costs ~0.8 us per token (the dict version: ~0.7). Memory: 8 bytes per token, and 2 to 4
16-byte table slots per (position, n) (a load of 1/4 after a rebuild, 1/2 before the next):
0.5-1 MB for a 4,000-token request with n in 1..4 (the dict version: ~1.7 MB). When the table
passes a load of 1/2 (finished requests' entries included: `forget` drops nothing), `_reindex`
builds a new one from the tracked requests' tokens: amortized O(1) per token, as the table has
doubled since the last one, but a pause: ~175 ms for 64 requests of 4,000 tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outrider.core import Request
from outrider.speculative.base import SeqDrafts
from outrider.speculative.ngram_device import ngram_drafts_no_sync
from outrider.speculative.ngram_index import Arena, Seq, Table, hash_constants, hash_ngrams

NgramKey = tuple[int, ...]

# Tokens a lookup on the device reads before a row's last: [B, 2049] int64 at every step that
# drafts there, one launch on a GPU (ngram_device.py); occurrences further back are the host's
# alone.
DEVICE_WINDOW = 2048


@dataclass(frozen=True)
class NgramConfig:
    """min_n..max_n: suffix lengths tried, longest first. num_draft_tokens: k, the default cap
    (the engine may ask for fewer per call). shared_cache: when a request's own tokens have no
    match, also look in recently finished requests, up to shared_cache_max_tokens tokens of them
    (least recently used requests are dropped whole). device_window: tokens before a row's
    last that the lookup inside the speculative step reads where steps run ahead
    (ngram_device.py; the host's reads the whole sequence); 0 drafts on the host only."""

    min_n: int = 1
    max_n: int = 4
    num_draft_tokens: int = 4
    shared_cache: bool = False
    shared_cache_max_tokens: int = 1 << 16
    device_window: int = DEVICE_WINDOW

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(
                f"invalid min_n={self.min_n}: use an integer >= 1 (1 matches single tokens; "
                "2 or 3 trades fewer drafts for more accurate ones)"
            )
        if self.max_n < self.min_n:
            raise ValueError(
                f"invalid n-gram range min_n={self.min_n}, max_n={self.max_n}: "
                f"use max_n >= min_n, e.g. max_n={max(4, self.min_n)}"
            )
        if self.num_draft_tokens < 1:
            raise ValueError(
                f"invalid num_draft_tokens={self.num_draft_tokens}: use an integer >= 1; "
                "to switch drafting off, pass max_draft_tokens=0 to propose()"
            )
        if self.device_window < 0:
            raise ValueError(
                f"invalid device_window={self.device_window}: use a token count >= 0 "
                f"(0 drafts on the host only; default {DEVICE_WINDOW})"
            )
        if self.shared_cache_max_tokens < 1:
            raise ValueError(
                f"invalid shared_cache_max_tokens={self.shared_cache_max_tokens}: use an "
                "integer >= 1, or shared_cache=False to disable the shared cache"
            )


def _index_tail(
    tokens: list[int], index: dict[NgramKey, int], start: int, min_n: int, max_n: int
) -> None:
    """Index every n-gram of `tokens` that gained a follower since `tokens` had `start` tokens.

    An n-gram starting at s has a follower when s + n <= L - 1. Those with s + n <= start - 1
    were indexed before, so the new starts are s in [max(0, start - n), L - 1 - n]; later starts
    overwrite earlier ones, which keeps the most recent occurrence.
    """
    end = len(tokens)
    for n in range(min_n, max_n + 1):
        first, last = max(0, start - n), end - 1 - n  # inclusive range of new starts
        if last < first:
            continue
        columns = [tokens[first + j : last + 1 + j] for j in range(n)]
        index.update(zip(zip(*columns), range(first, last + 1)))


class _SharedIndex:
    """n-gram -> (request id, start) over recently finished requests, bounded in tokens.

    Requests are kept in LRU order (a hit refreshes one) and evicted whole, oldest first, until
    the new one fits; a request longer than the whole budget is not kept. An n-gram seen in two
    kept requests points at the one added later; evicting that one drops the entry, so the older
    request's occurrence is forgotten too (the cache is a heuristic, not an exact union).

    Plain dicts: it is only read on a miss of the request's own tokens, and written once per
    finished request. Each kept request keeps its own index too (its key tuples are the very
    objects `_where` holds, so that costs only a dict table): eviction finds the request's keys
    without rebuilding its n-grams. Handing a 4,000-token request over and evicting one of the
    same size costs ~10 ms, once, inside `forget` (~0.6 us per n-gram).
    """

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        # request id -> (tokens, n-gram -> start); first = least recently used
        self._kept: OrderedDict[str, tuple[list[int], dict[NgramKey, int]]] = OrderedDict()
        self._where: dict[NgramKey, tuple[str, int]] = {}
        self.num_tokens = 0

    @property
    def request_ids(self) -> list[str]:
        return list(self._kept)

    def add(self, request_id: str, tokens: list[int]) -> None:
        if request_id in self._kept:
            self._remove(request_id)
        if len(tokens) > self.max_tokens or len(tokens) <= self.min_n:  # too long, or no n-gram
            return
        while self.num_tokens + len(tokens) > self.max_tokens:
            self._remove(next(iter(self._kept)))
        index: dict[NgramKey, int] = {}
        _index_tail(tokens, index, 0, self.min_n, self.max_n)
        self._kept[request_id] = (tokens, index)
        self.num_tokens += len(tokens)
        self._where.update(zip(index, zip(itertools.repeat(request_id), index.values())))

    def lookup(self, tail: list[int], k: int) -> list[int]:
        """tail: the sequence's last min(L, max_n) tokens. n <= L: the occurrence is in another
        request, so the whole sequence may be the suffix."""
        end = len(tail)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            hit = self._where.get(tuple(tail[end - n :]))
            if hit is not None:
                request_id, start = hit
                self._kept.move_to_end(request_id)
                return self._kept[request_id][0][start + n : start + n + k]
        return []

    def _remove(self, request_id: str) -> None:
        tokens, index = self._kept.pop(request_id)
        self.num_tokens -= len(tokens)
        where = self._where
        for key in index:
            hit = where.get(key)
            if hit is not None and hit[0] == request_id:  # else a later request took it over
                del where[key]


class NgramProposer:
    """Drafts by n-gram lookup in each request's own prompt and output (see the module doc).

    Satisfies `outrider.speculative.base.Proposer`. State is per request id and updated incrementally:
    requests only grow. A request whose tokens no longer extend what was indexed (shorter, or a
    different first or last indexed token) is re-indexed from scratch; that O(1) check misses an
    edit in the middle that keeps both ends, which the engine never makes.
    """

    name = "ngram"
    on_device = False
    aux_layers: tuple[int, ...] = ()
    writes_kv = False
    topk = 1

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        # Satisfies TokenDrafter too; the shared cache is the host's, so with it only the host
        # drafts (a step's lookup would miss what it finds).
        self.token_window = 0 if config.shared_cache else config.device_window
        self._seqs: dict[str, Seq] = {}
        self._serials = itertools.count()
        self._arena = Arena()
        self._table = Table()
        self._ns = np.arange(config.min_n, config.max_n + 1)  # [nr] the n tried, ascending
        self._coef, self._salt = hash_constants(config.max_n, self._ns)
        # [nr, max_n]: the window columns an n-gram uses, its last n
        self._used = np.arange(config.max_n) >= (config.max_n - self._ns)[:, None]
        self._shared = (
            _SharedIndex(config.min_n, config.max_n, config.shared_cache_max_tokens)
            if config.shared_cache
            else None
        )

    @property
    def num_tracked_requests(self) -> int:
        return len(self._seqs)

    @property
    def shared_request_ids(self) -> list[str]:
        """Requests in the shared cache, least recently used first (empty when it is off)."""
        return self._shared.request_ids if self._shared is not None else []

    @property
    def num_shared_tokens(self) -> int:
        return self._shared.num_tokens if self._shared is not None else 0

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        if max_draft_tokens < 0:
            raise ValueError(
                f"invalid max_draft_tokens={max_draft_tokens}: use 0 (no drafts) or more"
            )
        k = min(self.config.num_draft_tokens, max_draft_tokens)
        if k == 0:
            # Indexing is lazy: the next call with k > 0 catches up on what was appended.
            return [SeqDrafts.chain([]) for _ in requests]
        # A request id twice in one call (the engine never does it) splits the batch, so that
        # its second lookup sees its first catch-up, as one request after another would.
        drafts: list[SeqDrafts] = []
        first, seen = 0, set()
        for i, request in enumerate(requests):
            if request.request_id in seen:
                drafts += self._propose_batch(requests[first:i], k)
                first, seen = i, set()
            seen.add(request.request_id)
        drafts += self._propose_batch(requests[first:], k)
        return drafts

    def observe(self, batch, output) -> None:
        """Lookup indexes the request's own tokens in `propose`; nothing to catch up on."""

    def draft_from_tokens_no_sync(
        self, tokens: torch.Tensor, valid: torch.Tensor, k: int
    ) -> torch.Tensor:
        """TokenDrafter's lookup: the same drafts from each row's last token_window + 1 tokens,
        on their device (ngram_device.py)."""
        return ngram_drafts_no_sync(tokens, valid, self.config.min_n, self.config.max_n, k)

    def positions_needed(self, k: int) -> int:
        return 1 + k

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state; with the shared cache on, hand it to the cache."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None and self._shared is not None:
            self._shared.add(request_id, self._arena.tokens(seq))

    def _propose_batch(self, requests: Sequence[Request], k: int) -> list[SeqDrafts]:
        if not requests:
            return []
        max_n, ns, nr = self.config.max_n, self._ns, len(self._ns)
        # 1. Per request (not per token): catch up with what was appended since the last call.
        batch, span, new = [], [], []
        packs, one_each = self._arena.packs, True  # the usual decode step: one token each
        for request in requests:
            seq, done = self._sync(request, new)
            batch.append(seq)
            span += (seq.offset, seq.serial, done, seq.length)
            one_each = one_each and done > 0 and seq.length == done + 1
        if self._arena.packs != packs:  # segments moved while later requests grew
            span[::4] = [seq.offset for seq in batch]
        off, serial, done, end = np.array(span, np.int64).reshape(-1, 4).T  # [R] each
        buf, rows = self._arena.buf, np.arange(len(batch))
        if one_each:
            buf[off + done] = new
        elif new:
            count = end - done
            at = np.repeat(off + done - (np.cumsum(count) - count), count) + np.arange(len(new))
            buf[at] = new

        # 2. Windows of max_n tokens, one per end position, serving every n: the n-grams
        # ending at first_end..end-2 just gained a follower (inserted), the suffixes end at
        # end-1 (looked up).
        if one_each:
            num_new = len(rows)
            owner, ends = np.concatenate([rows, rows]), np.concatenate([end - 2, end - 1])
        else:
            first_end = np.maximum(done - 1, 0)
            count = np.maximum(end - 1 - first_end, 0)
            num_new = int(count.sum())
            owner = np.concatenate([np.repeat(rows, count), rows])
            ends = np.repeat(first_end - (np.cumsum(count) - count), count)
            ends = np.concatenate([ends + np.arange(num_new), end - 1])
        window, hashes = self._ngrams(off[owner], serial[owner], ends)  # [Q, max_n], [Q, nr]

        # 3. Insert first: a suffix may occur among this call's new n-grams. When the table is
        # full, a new one indexes every tracked request, these n-grams included.
        if num_new and self._table.has_room(num_new * nr):
            fits = ends[:num_new, None] >= ns - 1  # the n-gram starts at or after position 0
            self._table.put_max(hashes[:num_new][fits], (ends[:num_new, None] - ns + 1)[fits])
        elif num_new:
            self._reindex()

        # 4. Look the suffixes up, every n at once; the longest n that hit wins. A hit is exact
        # once the tokens at its start are the suffix and have a follower (the module doc says
        # why); else (a hash collision) the request is scanned.
        window = window[num_new:]
        start = self._table.get(hashes[num_new:].ravel()).reshape(-1, nr)  # [R, nr]
        start[end[:, None] < ns + 1] = -1  # no room for an earlier occurrence
        best = np.where(start >= 0, np.arange(nr), -1).max(1)  # [R], -1: no hit
        n = ns[best]
        follow = start[rows, best] + n  # the first draft's position
        # [R, max_n + k]: the n-gram found (right-aligned, as in `window`), then the drafts
        # (clipped: a miss or a collision may point anywhere; what it reads is not used)
        got = buf.take((off + follow - max_n)[:, None] + np.arange(max_n + k), mode="clip")
        wrong = ((got[:, :max_n] != window) & self._used[best]).any(1) | (follow >= end)
        count = np.where(best >= 0, np.minimum(k, end - follow), 0)
        drafts = [row[:c] for row, c in zip(got[:, max_n:].tolist(), count.tolist())]
        wrong &= best >= 0
        if wrong.any():
            for i in np.flatnonzero(wrong).tolist():
                drafts[i] = self._scan(batch[i], k)
        if self._shared is not None:
            for i, row in enumerate(drafts):
                if not row:
                    drafts[i] = self._shared.lookup(self._arena.tokens(batch[i], max_n), k)
        return [SeqDrafts.chain(row) for row in drafts]

    def _ngrams(
        self, off: np.ndarray, serial: np.ndarray, ends: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Windows [Q, max_n] of the tokens ending at `ends` [Q] in the segments at `off` [Q]
        (clipped at the segment's start) and their n-gram hashes [Q, nr] for requests `serial`
        [Q]; an n-gram is a window's last n tokens."""
        back = np.arange(self.config.max_n) - (self.config.max_n - 1)
        window = self._arena.buf[off[:, None] + np.maximum(ends[:, None] + back, 0)]
        return window, hash_ngrams(window, serial, self._coef, self._salt)

    def _reindex(self) -> None:
        """A new table holding every tracked request's n-grams that have a follower; the old
        one's entries of forgotten or re-indexed requests are gone. O(tracked tokens), as the
        table has doubled (or holds mostly dead entries) since the last one: amortized O(1)."""
        seqs = [s for s in self._seqs.values() if s.length > 1]
        self._table = Table(sum(s.length - 1 for s in seqs) * len(self._ns))
        for s in seqs:  # a loop over requests, to bound the temporary arrays
            ends = np.arange(s.length - 1)
            _, hashes = self._ngrams(
                np.full(len(ends), s.offset), np.full(len(ends), s.serial), ends
            )
            fits = ends[:, None] >= self._ns - 1
            self._table.put_max(hashes[fits], (ends[:, None] - self._ns + 1)[fits])

    def _scan(self, seq: Seq, k: int) -> list[int]:
        """The exact answer by comparing the suffix with every position: O(L * max_n), only
        for a hash collision (about never with 64-bit hashes; tests force it)."""
        tokens = self._arena.buf[seq.offset : seq.offset + seq.length]
        end = len(tokens)
        for n in range(min(self.config.max_n, end - 1), self.config.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: end - 1], n)
            hits = np.flatnonzero((windows == tokens[end - n :]).all(1))
            if hits.size:
                return tokens[hits[-1] + n : hits[-1] + n + k].tolist()
        return []

    def _sync(self, request: Request, new: list[int]) -> tuple[Seq, int]:
        """The request's state, grown (not yet filled) for the tokens appended since the last
        call, which go to the end of `new`; and how many tokens it had before."""
        prompt, output = request.prompt_token_ids, request.output_token_ids
        num_prompt = len(prompt)
        end = num_prompt + len(output)
        seq = self._seqs.get(request.request_id)
        if seq is None:
            seq = self._seqs[request.request_id] = Seq(next(self._serials))
        done = seq.length
        if done and (  # tokens 0 and done-1 of prompt + output, read without building it
            end < done
            or (prompt[0] if num_prompt else output[0]) != seq.first
            or (prompt[done - 1] if done <= num_prompt else output[done - 1 - num_prompt])
            != seq.last
        ):
            # Shrunk or replaced. The engine does neither today (preemption keeps the tokens), but
            # a stale index would draft from positions that no longer hold those tokens.
            seq = self._seqs[request.request_id] = Seq(next(self._serials))
            done = 0
        if done < end:
            tail = prompt[done:] + output if done < num_prompt else output[done - num_prompt :]
            if end > seq.capacity:
                self._arena.reserve(seq, end, self._seqs.values())
            new += tail
            if not done:
                seq.first = tail[0]
            seq.length, seq.last = end, tail[-1]
        return seq, done


def build_ngram_proposer(config, runner=None, checkpoint=None) -> NgramProposer:
    """config: SpecConfig (the registry's builder signature; n-gram needs no model)."""
    return NgramProposer(
        NgramConfig(
            min_n=config.ngram_min_n,
            max_n=config.ngram_max_n,
            num_draft_tokens=config.num_draft_tokens,
        )
    )
