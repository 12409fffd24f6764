"""Stop strings through the Aho-Corasick automaton: the same matches, cuts and held-back tails
as scanning every stop string over the text (the reference here), on many seeded random cases,
and a cost per character that stays put as the number of stop strings grows."""

from __future__ import annotations

import random

import pytest

from outrider.core import Request, SamplingParams
from outrider.engine.detokenizer import IncrementalDetokenizer
from outrider.engine.stop_strings import StopStrings


def earliest_match(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Every stop string tried at every start whose match would end past old_len: the earliest
    start wins, then the shorter string."""
    found = [
        (i, len(s), s)
        for s in stops
        for i in range(max(0, old_len - len(s) + 1), len(text) - len(s) + 1)
        if text.startswith(s, i)
    ]
    return min(found)[::2] if found else None


def held_prefix(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string."""
    return max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )


def reference_stream(chunks: list[str], stops: list[str], include: bool) -> list[str]:
    """The deltas the detokenizer must return for `chunks` (then flush), by brute force."""
    text, emitted, stopped, out = "", 0, False, []
    for chunk in chunks:
        if stopped:
            out.append("")
            continue
        old_len = len(text)
        text += chunk
        hit = earliest_match(text, old_len, stops)
        if hit is not None:
            start, stop = hit
            text, stopped = text[: start + len(stop) if include else start], True
            stable = len(text)
        else:
            stable = len(text) - (0 if include else held_prefix(text, stops))
        out.append(text[emitted:stable])
        emitted = max(emitted, stable)
    out.append(text[emitted:])
    return out


class CharTokenizer:
    """Token id = code point."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


def random_case(rng: random.Random, alphabet: str) -> tuple[list[str], list[str]]:
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        for _ in range(rng.randint(1, 6))
    ]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        chunks.append(text[i : i + n])
        i += n
    return stops, chunks


@pytest.mark.parametrize("alphabet", ["ab", "abc", "a b\n"])
def test_automaton_agrees_with_scanning_every_stop_string(alphabet: str) -> None:
    rng = random.Random(f"matcher-{alphabet}")
    for _ in range(1500):
        stops, chunks = random_case(rng, alphabet)
        matcher, text = StopStrings(stops), ""
        for chunk in chunks:
            old_len = len(text)
            text += chunk
            want = earliest_match(text, old_len, stops)
            assert matcher.feed(chunk) == want, (stops, chunks, text)
            if want is not None:
                break
            assert matcher.pending == held_prefix(text, stops), (stops, text)


@pytest.mark.parametrize("alphabet", ["ab", "abc"])
def test_detokenizer_streams_as_the_reference_does(alphabet: str) -> None:
    rng = random.Random(f"detok-{alphabet}")
    for _ in range(1500):
        stops, chunks = random_case(rng, alphabet)
        include = rng.random() < 0.3
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(CharTokenizer(), Request([], params))
        got = [detok.update([ord(c) for c in chunk]) for chunk in chunks] + [detok.flush()]
        want = reference_stream(chunks, stops, include)
        assert got == want, (stops, chunks, include)
        assert detok.text == "".join(want)
        assert detok.stop_hit == (detok.stop_str is not None)


def test_the_earliest_start_wins_across_one_delta_and_ties_go_to_the_shorter() -> None:
    assert StopStrings(["bcd", "abcdef"]).feed("xabcdefg") == (1, "abcdef")
    assert StopStrings(["abcd", "ab"]).feed("abcd") == (0, "ab")
    stops = StopStrings(["he", "she", "hers"])
    assert stops.feed("us") is None and stops.pending == 1  # "s" may begin "she"
    assert stops.feed("he") == (1, "she")
    stops = StopStrings(["ab"])
    assert stops.feed("xa") is None and stops.pending == 1
    assert stops.feed("b") == (1, "ab")  # the start counts every character fed


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["a", ""])


@pytest.mark.parametrize("count", [1, 64, 4096])
def test_moves_per_character_do_not_grow_with_the_number_of_stop_strings(count: int) -> None:
    """Each character costs one move plus failure moves repaid by earlier characters: at most
    two moves a character over the text, and a step at most 2 x its characters plus the longest
    stop string, whether there is one stop string or thousands (scanning each one per step
    would cost `count` times the window)."""
    rng = random.Random(7)
    longest = 12
    stops = [
        "".join(rng.choice("abc") for _ in range(rng.randint(4, longest))) + "d"
        for _ in range(count)
    ]  # never matched ("d" is never generated), always a prefix in reach
    matcher = StopStrings(stops)
    text = "".join(rng.choice("abc") for _ in range(6000))
    for i in range(0, len(text), 4):
        before = matcher.steps
        assert matcher.feed(text[i : i + 4]) is None
        assert matcher.steps - before <= 2 * 4 + longest
    assert len(text) <= matcher.steps <= 2 * len(text)
