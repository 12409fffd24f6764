"""Kimi-style tiktoken tokenizers (tiktoken.model + tokenizer_config.json): a vocabulary trained
here by byte-level BPE over Kimi's pre-tokenizer, written in tiktoken's file format, loads
through Tokenizer.from_hf_dir and encodes exactly as tiktoken's algorithm does (a reference
written here: whole pre-token lookup, else the lowest-rank adjacent join until none is a
token), with its special tokens, chat template and end-of-turn id."""

from __future__ import annotations

import base64
import collections
import json
from pathlib import Path

import pytest
import regex

from outrider.loaders.tiktoken_vocab import KIMI_SPLIT, NUM_RESERVED_SPECIAL
from outrider.loaders.tokenizer import Tokenizer

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's the dog's day; they'll see. "
    "HelloWorld and CamelCase words, UPPER lower MiXeD. Numbers 12345 and 3.14159, 2026-12-02.\n"
    "你好，世界！我们今天学习分词。中文和English混合 text。\n"
    "    indented code: def f(x):\n        return x * 2  # comment\n\n"
    "Emoji 🙂 and accents café naïve résumé. Tabs\tand\r\nwindows lines."
) * 3
TEXTS = [
    "The quick brown fox.",
    "It's HelloWorld's CamelCase; they'll DON'T.",
    "你好，世界！中文English混合",
    "Numbers 1234567 and 3.14159",
    "    def f(x):\n        return x  # done\n\n\n",
    "café 🙂 naïve\r\n\tend",
    "unseen words zyxwv QQQ 999",
    "",
]
SPLIT = regex.compile(KIMI_SPLIT, flags=regex.V1)  # V1: `&&` is class intersection


def reference_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while True:
        joins = [
            (ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks
        ]
        if not joins:
            return [ranks[p] for p in parts]
        _, i = min(joins)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def reference_encode(text: str, ranks: dict[bytes, int], specials: dict[str, int]) -> list[int]:
    """tiktoken's encode(allowed_special="all")."""
    out: list[int] = []
    pattern = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
    pos = 0
    for m in [*regex.finditer(pattern, text), None]:
        chunk = text[pos : m.start() if m else len(text)]
        for piece in SPLIT.findall(chunk):
            out += reference_bpe(piece.encode(), ranks)
        if m:
            out.append(specials[m.group()])
            pos = m.end()
    return out


def train_ranks(corpus: str, merges: int) -> list[bytes]:
    """Byte-level BPE: the 256 bytes, then the most frequent adjacent pair within pre-tokens."""
    tokens = [bytes([b]) for b in range(256)]
    words = collections.Counter(
        tuple(bytes([b]) for b in p.encode()) for p in SPLIT.findall(corpus)
    )
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        tokens.append(a + b)
        merged = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return tokens


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> tuple[Path, list[bytes]]:
    d = tmp_path_factory.mktemp("kimi_tok")
    tokens = train_ranks(CORPUS, 150)
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(tokens)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(tokens)
    names = {base: "[BOS]", base + 1: "[EOS]", base + 4: "<|im_end|>", base + 5: "<|im_user|>",
             base + 6: "<|im_assistant|>", base + 7: "<|im_middle|>"}  # fmt: skip
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>{% else %}"
        "<|im_assistant|>{% endif %}{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    )
    config = {
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in names.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": template,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": base + 4}))
    return d, tokens


def test_encodes_as_tiktoken_does_and_decodes_back(kimi_dir):
    d, tokens = kimi_dir
    tok = Tokenizer.from_hf_dir(d)
    ranks = {t: i for i, t in enumerate(tokens)}
    base = len(tokens)
    specials = {tok.id_to_token(i): i for i in range(base, base + NUM_RESERVED_SPECIAL)}
    assert len(tokens) == 256 + 150 and tok.vocab_size == base + NUM_RESERVED_SPECIAL
    multi = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference_encode(text, ranks, specials), text
        assert tok.decode(ids) == text
        multi += sum(len(tokens[i]) > 1 for i in ids)
    assert multi > 20  # the merges were exercised, not just single bytes


def test_special_tokens_ids_template_and_end_of_turn(kimi_dir):
    d, tokens = kimi_dir
    tok = Tokenizer.from_hf_dir(d)
    base = len(tokens)
    assert tok.token_to_id("[BOS]") == base and tok.token_to_id("[EOS]") == base + 1
    assert tok.token_to_id("<|im_end|>") == base + 4
    assert tok.token_to_id(f"<|reserved_token_{base + 2}|>") == base + 2  # unnamed: reserved
    assert tok.bos_token_id == base
    assert base + 4 in tok.eos_token_ids and base + 1 in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好 world"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == base + 5 and ids[-1] == base + 7  # <|im_user|> ... <|im_middle|>
    assert ids.count(base + 4) == 1  # <|im_end|> matched whole, once
    assert tok.decode(ids, skip_special_tokens=True) == "user你好 worldassistant"


def test_a_broken_tiktoken_file_names_the_line(tmp_path):
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-a-token-line\n")
    with pytest.raises(ValueError, match="line 2 is not `<base64 token> <rank>`"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match=r"ranks are not 0\.\.1"):
        Tokenizer.from_hf_dir(tmp_path)


def test_a_directory_without_either_tokenizer_file_says_what_is_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        Tokenizer.from_hf_dir(tmp_path)
