"""Stop-string matching whose cost per character does not grow with the number of stop strings:
one Aho-Corasick automaton over a request's stop strings, fed only the text each step adds.

The automaton is a trie of the stop strings with a failure link per node (the node of the
longest proper suffix of its string that is also in the trie). Its state after some text is
the node of the longest tail of that text that begins a stop string:

    stops "she", "he"
    text "us"       state "s": one character held back, it may begin "she"
    then "he"       state "she": "she" ends here, and its suffix "he" too (the longer one
                    starts earlier: it is the match)
    text "sha"      state "sh" held 2 characters; "a" falls back along the failure links to
                    the root: nothing held

Each character takes one trie move plus at most as many failure moves as earlier characters
went down the trie: over a step, 2 x (new characters) + (the longest stop string) moves at
most, whatever the number of stop strings. Building costs their total length, once per set.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

# Automata kept for the requests that follow their check (EngineCore.validate builds one where
# the request is checked, so the engine thread finds it built): a 64 x 256-character set is
# ~16K nodes, 10-30 ms to build and ~2 MB (benchmarks/stop_strings.py).
MAX_CACHED = 16
_SPAN = 0x110000  # code points: a transition's key is node * _SPAN + ord(character)


class StopAutomaton:
    """The trie of a set of stop strings, its failure links and the match at each node;
    immutable once built, shared by every request with the same stop strings. Flat lists and
    one dict of int keys, no object per node: ~16K nodes build in 10-30 ms, and the collector has
    nothing new to walk."""

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        # next[node * _SPAN + ord(character)] -> child; node 0 is the root (the empty string)
        self.next: dict[int, int] = {}
        self.depth = [0]  # length of the node's string
        parent, char = [0], [0]  # of each node
        ends: list[str | None] = [None]  # the stop string that is the node's string
        for stop in stops:
            node = 0
            for ch in stop:
                key = node * _SPAN + ord(ch)
                child = self.next.get(key)
                if child is None:
                    child = self.next[key] = len(self.depth)
                    self.depth.append(self.depth[node] + 1)
                    parent.append(node)
                    char.append(ord(ch))
                    ends.append(None)
                node = child
            ends[node] = stop
        # Shallow nodes first, so a node's failure target (shorter) is done before it.
        # match[node]: the longest stop string that is a suffix of the node's string (the
        # earliest start of those ending there), or None.
        self.fail = [0] * len(self.depth)
        self.match = ends
        for node in sorted(range(1, len(self.depth)), key=self.depth.__getitem__):
            up, c = parent[node], char[node]
            if not up:
                continue  # one character: its only proper suffix is the root
            fail = self.fail[up]
            while fail and fail * _SPAN + c not in self.next:
                fail = self.fail[fail]
            target = self.fail[node] = self.next.get(fail * _SPAN + c, 0)
            if self.match[node] is None:
                self.match[node] = self.match[target]


@functools.lru_cache(maxsize=MAX_CACHED)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, built once while it stays among the last MAX_CACHED used."""
    return StopAutomaton(stops)


class StopStrings:
    """One request's stop strings and how far the text fed so far has matched them.

    feed(text) returns the earliest stop string (smallest start; on a tie the shorter one,
    which completed first) among the matches that end inside `text`, with its start counted in
    all text fed. `pending` is the longest tail of the text fed that is a proper prefix of a
    stop string while nothing has matched: what could still grow into one. `steps` counts
    trie and failure moves, the whole cost of matching.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._automaton = automaton(tuple(stops))
        self._node = 0
        self._fed = 0  # characters fed so far
        self.steps = 0

    @property
    def pending(self) -> int:
        return self._automaton.depth[self._node]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; the earliest match ending in it as (start, stop string)."""
        a = self._automaton
        nxt, fail, match = a.next, a.fail, a.match
        node, steps, best = self._node, 0, None
        for end, c in enumerate(map(ord, text), self._fed + 1):
            while True:
                steps += 1
                child = nxt.get(node * _SPAN + c)
                if child is not None:
                    node = child
                    break
                if not node:
                    break
                node = fail[node]
            stop = match[node]
            if stop is not None and (best is None or end - len(stop) < best[0]):
                best = (end - len(stop), stop)  # a later end with the same start is longer
        self._node, self._fed = node, self._fed + len(text)
        self.steps += steps
        return best
