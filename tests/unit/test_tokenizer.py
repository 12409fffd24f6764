"""Tokenizer: GGUF vocabularies rebuilt as `tokenizers` objects (checked against the tokenizer
they came from, or transformers' GGUF tokenizer), HF directories, and chat templates rendered
as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from outrider.loaders.checkpoint import default_model_path
from outrider.loaders.gguf import GGUFFile
from outrider.loaders.gguf_tokenizer import _LLAMA3_SPLIT
from outrider.loaders.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog 1234 times.",
    "def add(a, b):\n    return a + b  # sum\n",
    "Hello world! It's a test, isn't it? We'll see 42 cats.",
    "naïve café ünïcödé 東京 🚀",
    "  spaces   and\ttabs\n\nnewlines 2024-01-01",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world!",
    "12345",
    " 12345 678",
    "x  1",  # whitespace run before a digit: where split order matters
    "   leading spaces",
    "def f(x):\n    return x**2  # square\n",
    "naïve café 東京 🚀🎉",
    "<|im_start|>user\nHi<|im_end|>\n",
    "it's we'll THEY'RE",
    "\n\n\t \n",
    "quick <think>brown</think> fox",
    "",
]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_byte_level(splits: list[str], regex_in_byte_level: bool) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex_in_byte_level)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def gguf_fields(tok: tokenizers.Tokenizer, pre: str, **extra: object) -> dict[str, object]:
    """What llama.cpp's converter stores for a byte-level BPE tokenizer."""
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 4 if t.endswith("think>") else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
        **extra,
    }


@pytest.fixture(scope="module")
def smollm_style() -> tokenizers.Tokenizer:
    # SmolLM2's own tokenizer.json: digits split off first, then GPT-2's byte-level regex.
    return train_byte_level([r"\p{N}"], regex_in_byte_level=True)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_gguf_byte_level_bpe_matches_source_tokenizer(smollm_style, pre: str) -> None:
    source = smollm_style if pre == "smollm" else train_byte_level([_LLAMA3_SPLIT], False)
    ours = Tokenizer.from_gguf_fields(
        gguf_fields(source, pre, **{"tokenizer.ggml.add_bos_token": False})
    )
    assert ours.vocab_size == source.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_gguf_special_tokens_single_ids_skipped_on_decode(smollm_style) -> None:
    tok = Tokenizer.from_gguf_fields(gguf_fields(smollm_style, "smollm"))
    im_start, im_end, think = (
        tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")
    )
    ids = tok.encode("<|im_start|>hi <think>x<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end and think in ids
    assert tok.all_special_ids == frozenset({0, 1, 2})  # CONTROL only; <think> is USER_DEFINED
    assert tok.decode(ids) == "hi <think>x"
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)


def test_gguf_bos_added_only_when_the_model_says(smollm_style) -> None:
    with_bos = Tokenizer.from_gguf_fields(
        gguf_fields(smollm_style, "smollm", **{"tokenizer.ggml.add_bos_token": True})
    )
    without = Tokenizer.from_gguf_fields(
        gguf_fields(smollm_style, "smollm", **{"tokenizer.ggml.add_bos_token": False})
    )
    assert with_bos.encode("hi") == [1, *without.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == without.encode("hi")
    # llama-bpe files that say nothing get BOS, as llama.cpp gives them.
    assert Tokenizer.from_gguf_fields(gguf_fields(smollm_style, "llama-bpe")).encode("hi")[0] == 1


def test_gguf_end_of_turn_ids_are_eos(smollm_style) -> None:
    fields = gguf_fields(smollm_style, "smollm", **{"tokenizer.ggml.eot_token_id": 0})
    assert Tokenizer.from_gguf_fields(fields).eos_token_ids == (2, 0)


def test_gguf_unknown_tokenizer_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'bert'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def _write_spm_gguf(path: Path) -> list[str]:
    """A tiny SentencePiece-style ("llama") vocabulary: pieces ranked by score, byte tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    for write in (
        writer.write_header_to_file,
        writer.write_kv_data_to_file,
        writer.write_tensors_to_file,
    ):
        write()
    writer.close()
    return tokens


def test_gguf_sentencepiece_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf_fields(GGUFFile(tmp_path / "spm.gguf").tokenizer_fields())
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in [
        "The quick brown fox",
        "Hello world! 42 cats",
        "café €5 東京",
        "two  spaces",
        "a\nb",
    ]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[0] == 1
        assert ours.decode(ours.encode(text)) == text
    assert len(ours.encode("€")) == 1 + 4  # BOS, "▁", then three byte-fallback tokens
    # Text that starts with a space still gets the dummy prefix, as in sentencepiece and
    # llama.cpp (Llama-2 encodes " Hello" as "▁", "▁Hello"); transformers' GGUF tokenizer
    # (Metaspace, prepend_scheme="first") skips it, so it is not the reference here.
    pieces = [ours.id_to_token(i) for i in ours.encode("  x")]
    assert pieces == ["<s>", "▁", "▁", "▁", "x"] and ours.decode(ours.encode("  x")) == "  x"


# ---- HF directories and chat templates ----------------------------------------------------


def write_hf_tokenizer(
    path: Path, tok: tokenizers.Tokenizer, template: str | None = CHATML
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}  # older configs' form
    config = {"bos_token": "<|im_start|>", "eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))


def test_hf_dir_special_ids_merged(tmp_path: Path, smollm_style) -> None:
    write_hf_tokenizer(tmp_path, smollm_style)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == (2, 0) and tok.bos_token_id == 1
    assert tok.encode("x  1 <|im_end|>") == smollm_style.encode("x  1 <|im_end|>").ids
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_hf_dir_without_tokenizer_json_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json.*save_pretrained"):
        Tokenizer.from_hf_dir(tmp_path)


MESSAGES = [
    {"role": "system", "content": "Be brief <b>&</b>."},
    {"role": "user", "content": "What is 2+2?", "tool_calls": None},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Ünïcode 🚀?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"a": "<int>"}}}]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tmp_path: Path, smollm_style, generation_prompt
) -> None:
    from transformers import AutoTokenizer

    template = CHATML + (
        "{% generation %}{{ messages | length }}{% endgeneration %}"
        "{% for m in messages %}{% if m.tool_calls is defined %}{{ raise_exception('None leaked') }}"
        "{% endif %}{% endfor %}"
    )
    write_hf_tokenizer(tmp_path, smollm_style, template)
    ours = Tokenizer.from_hf_dir(tmp_path).apply_chat_template(
        MESSAGES, add_generation_prompt=generation_prompt, tools=TOOLS
    )
    ref = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation_prompt, tools=TOOLS
    )
    assert ours == ref
    assert '"<int>"' in ours and ours.startswith("<|im_start|><|im_start|>system")


def test_chat_template_errors_are_value_errors(tmp_path: Path, smollm_style) -> None:
    write_hf_tokenizer(
        tmp_path / "a", smollm_style, "{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer.from_hf_dir(tmp_path / "a").apply_chat_template(MESSAGES)
    write_hf_tokenizer(tmp_path / "b", smollm_style, None)
    with pytest.raises(ValueError, match=r"no chat template.*--raw"):
        Tokenizer.from_hf_dir(tmp_path / "b").apply_chat_template(MESSAGES)
    write_hf_tokenizer(tmp_path / "c", smollm_style, "{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError):  # sandboxed: templates are untrusted code
        Tokenizer.from_hf_dir(tmp_path / "c").apply_chat_template(MESSAGES)


def test_chat_template_strftime_now(tmp_path: Path, smollm_style) -> None:
    write_hf_tokenizer(tmp_path, smollm_style, "{{ strftime_now('%Y') }}")
    year = Tokenizer.from_hf_dir(tmp_path).apply_chat_template([])
    assert year.isdigit() and int(year) >= 2024


# ---- the embedded default model against transformers' GGUF tokenizer ---------------------

DEFAULT_MODEL_TEXTS = [
    "Hello, world!", "12345", " 12345 678", "   leading spaces", "tab\there",
    "def f(x):\n    return x**2  # square\n", "naïve café — 東京 🚀🎉 emoji",
    "<|im_start|>user\nHi there<|im_end|>\n", "it's we'll they're I'M", "\n\n\n  \t ",
    "0.5e-10 +3,141.59", "<|endoftext|>text<|im_end|>", "price: $1,000,000.00!!!", "",
]  # fmt: skip


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers() -> None:
    from transformers import AutoTokenizer

    path = default_model_path()
    tok = Tokenizer.from_gguf_fields(GGUFFile(path).tokenizer_fields())
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in DEFAULT_MODEL_TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    for extra in ([], [{"role": "system", "content": "Be brief."}]):
        for gen in (True, False):
            want = ref.apply_chat_template(
                extra + messages, tokenize=False, add_generation_prompt=gen
            )
            assert tok.apply_chat_template(extra + messages, add_generation_prompt=gen) == want
    # Where transformers' GGUF tokenizer is wrong: llama.cpp's "smollm" pre-tokenizer (and
    # SmolLM2's tokenizer.json) split digits off before the GPT-2 regex, so a run of spaces
    # before a digit stays one token; transformers splits it into single spaces.
    pieces = [tok.id_to_token(i) for i in tok.encode("x  1")]
    assert pieces == ["x", "ĠĠ", "1"] and ref.convert_ids_to_tokens(ref.encode("x  1"))[1] == "Ġ"
