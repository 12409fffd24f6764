"""Tokenizer on long texts: the same ids and text as tokenizers' own calls, with the GIL let go
while Rust works (so a server's event loop runs on), and a least token count from a text's
length that never exceeds what encoding gives, where the pipeline promises one at all."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import tokenizers
from tokenizers import AddedToken, models, normalizers, pre_tokenizers

from outrider.loaders.checkpoint import default_model_path
from outrider.loaders.gguf import GGUFFile
from outrider.loaders.tokenizer import TextTooLong, Tokenizer
from tests.unit.test_tokenizer import (
    CHATML,
    _write_spm_gguf,
    gguf_fields,
    train_byte_level,
)


@pytest.fixture(scope="module")
def default() -> Tokenizer:
    return Tokenizer.from_gguf_fields(GGUFFile(default_model_path()).tokenizer_fields())


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    source = train_byte_level([r"\p{N}"], regex_in_byte_level=True)
    return Tokenizer.from_gguf_fields(gguf_fields(source, "smollm"))


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    _write_spm_gguf(path)
    return Tokenizer.from_gguf_fields(GGUFFile(path).tokenizer_fields())


def _texts(seed: int = 0) -> list[str]:
    """What a length bound could get wrong: long runs of one character (one token may cover
    many), special-token text, controls a vocabulary may lack, any Unicode."""
    rng = random.Random(seed)
    anything = "".join(
        chr(c) for c in (rng.randrange(0, 0x2FFFF) for _ in range(5000)) if not 0xD800 <= c < 0xE000
    )
    runs = [c * 20_000 for c in (" ", "\n", "\t", "=", "-", ".", "a", "0", "\x04", "é", "東")]
    return [*runs, "\n" + " " * 20_000, "<|im_start|>" * 500, " \n" * 5000, "\x04a" * 500, anything]


def test_long_texts_encode_and_decode_as_tokenizers_does(default):
    text = " ".join(["the quick brown fox", "naïve 東京 🚀", "1234", "\n\n"] * 2000)
    ids = default.encode(text)
    assert ids == default.backend.encode(text).ids
    assert (
        default.encode(text, add_special_tokens=False)
        == default.backend.encode(text, add_special_tokens=False).ids
    )
    assert default.decode(ids) == default.backend.decode(ids)
    assert default.decode(ids, False) == default.backend.decode(ids, skip_special_tokens=False)
    assert default.token_texts[ids[3]] == default.decode([ids[3]], False)
    assert len(default.token_texts) == default.vocab_size


@pytest.mark.slow
def test_long_texts_let_other_threads_run_while_they_encode(default):
    text = "the quick brown fox jumps over the lazy dog 1234 " * 40_000  # ~2M characters
    done = threading.Event()
    turns = 0

    def encode() -> None:
        default.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    while not done.is_set():  # tokenizers' own encode() would hold the GIL until it returns
        time.sleep(0.001)
        turns += 1
    worker.join()
    assert turns >= 10


@pytest.mark.parametrize("name", ["default", "byte_level", "spm"])
def test_least_tokens_never_exceeds_the_real_count(request, name):
    tok = request.getfixturevalue(name)
    assert tok.least_tokens("x" * 10_000) > 0  # each of these promises a bound
    for text in _texts():
        for special in (True, False):
            assert len(tok.encode(text, add_special_tokens=special)) >= tok.least_tokens(text)


def test_the_default_vocabulary_drops_the_controls_it_lacks(default):
    # SmolLM2 has no token for 0x04 and five more ASCII controls: text of them encodes to nothing.
    assert default.encode("\x04" * 100) == [] and default.least_tokens("\x04" * 100) == 0
    assert default.least_tokens("a" * 810) == 10  # its longest token spells 81 characters


def test_a_rendered_conversation_too_long_for_its_limit_is_refused_unencoded(default):
    messages = [{"role": "user", "content": "word " * 200_000}]
    with pytest.raises(TextTooLong) as e:
        default.encode_chat(messages, max_tokens=8191)
    assert e.value.chars > 1_000_000 and e.value.least > 8191 and e.value.max_tokens == 8191
    assert "characters" in str(e.value)
    short = [{"role": "user", "content": "Hi"}]
    assert default.encode_chat(short, max_tokens=8191) == default.encode_chat(short)


def _changed(tok: Tokenizer, change) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    change(backend)
    return Tokenizer(backend)


def _unknown_fused(backend: tokenizers.Tokenizer) -> None:
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.model = models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True)


@pytest.mark.parametrize(
    "change",
    [
        lambda b: setattr(b, "normalizer", normalizers.NFC()),  # may compose 3 characters to 1
        lambda b: setattr(b, "normalizer", normalizers.Replace("ab", "c")),
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Whitespace()),  # drops whitespace
        lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Split(" ", behavior="removed")),
        lambda b: setattr(b, "model", models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
        _unknown_fused,  # one unknown token for a run of unknown characters
        lambda b: b.enable_truncation(8),
        lambda b: b.add_tokens([AddedToken("<mask>", lstrip=True)]),  # takes the spaces before it
    ],
)
def test_pipelines_that_may_drop_or_merge_text_promise_no_bound(byte_level, change):
    assert _changed(byte_level, lambda b: None).least_tokens("x" * 1000) > 0
    assert _changed(byte_level, change).least_tokens("x" * 1000) == 0


def test_a_tokenizer_without_a_bound_refuses_nothing_by_length():
    backend = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(backend, chat_template=CHATML)
    assert tok.least_tokens("hi " * 100_000) == 0
    assert len(tok.encode_chat([{"role": "user", "content": "hi " * 10}], max_tokens=1)) > 1


def test_sentencepiece_normalizers_keep_the_bound(spm):
    assert json.loads(spm.backend.to_str())["normalizer"]["type"] == "Sequence"
    assert spm.least_tokens("x" * 1000) > 0
    nfkc = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    assert _changed(spm, lambda b: setattr(b, "normalizer", nfkc)).least_tokens("x" * 1000) == 0
