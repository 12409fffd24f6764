"""A GGUF file's `tokenizer.*` metadata -> a `tokenizers.Tokenizer` as llama.cpp tokenizes:
tokenizer.ggml.model "gpt2" is byte-level BPE, pre-tokenized per tokenizer.ggml.pre; "llama" is
SentencePiece-style BPE with byte fallback. Every field is checked before it is used."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from outrider.loaders.vocab_common import byte_alphabet

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType): CONTROL tokens are special (matched whole, skipped on
# decode), USER_DEFINED ones are plain added tokens (matched whole, kept on decode).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes per tokenizer.ggml.pre, as llama.cpp's llama-vocab.cpp applies them before
# byte-level BPE. Each equals the regex in the model's own tokenizer.json.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_PRE: dict[str, tuple[str, ...]] = {  # pre type -> regexes, applied in turn
    "gpt2": (_GPT2_SPLIT,),
    # StarCoder-style vocabularies (SmolLM among them) split every digit off first.
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (r"\p{N}", _GPT2_SPLIT),
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2_SPLIT,)),
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these (HF's
# "ignore_merges": true), and adds BOS unless the file says otherwise.
_LLAMA3_LIKE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"})


def build(
    fields: dict[str, Any], path: str | Path | None = None
) -> tuple[tokenizers.Tokenizer, dict]:
    """(the backend, the rest of Tokenizer's arguments: chat template, BOS and end ids, special
    tokens) from `fields` (keys as in the file); `path` names the file in errors."""
    where = f"GGUF file {str(path)!r}" if path is not None else "the GGUF"
    _check_gguf_fields(fields, where)
    kind = fields.get("tokenizer.ggml.model")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = fields.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, fields.get("tokenizer.ggml.merges") or [], pre)
        default_bos = pre in _LLAMA3_LIKE
    elif kind == "llama":
        add_space = fields.get("tokenizer.ggml.add_space_prefix", True)
        backend = _sentencepiece_bpe(tokens, types, fields, add_space)
        default_bos = True
    else:
        raise ValueError(
            f"{where} has tokenizer.ggml.model={kind!r}: outrider builds 'gpt2' (byte-level "
            f"BPE) and 'llama' (SentencePiece BPE) tokenizers; use the model's HF directory"
        )
    _add_gguf_special_tokens(backend, tokens, types, where)

    def token(key: str) -> str | None:
        i = fields.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    add_bos = fields.get("tokenizer.ggml.add_bos_token", default_bos) and bos_id is not None
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False)
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    bos = [tokens[bos_id]] if add_bos else []
    eos = [tokens[eos_id]] if add_eos and eos_id is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B", *eos],
        special_tokens=list({tokens[i]: i for i in (bos_id, eos_id) if i is not None}.items()),
    )
    ends = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    names = {
        "bos_token": "bos",
        "eos_token": "eos",
        "unk_token": "unknown",
        "pad_token": "padding",
    }
    return backend, {
        "chat_template": fields.get("tokenizer.chat_template"),
        "bos_token_id": bos_id,
        "eos_token_ids": [i for i in ends if i is not None],
        "special_tokens": {k: t for k, v in names.items() if (t := token(f"{v}_token_id"))},
        "chat_template_origin": f"the tokenizer.chat_template in {where}",
    }


_GGUF_TOKEN_IDS = ("bos", "eos", "eot", "eom", "unknown")


def _check_gguf_fields(fields: dict[str, Any], where: str) -> None:
    """The tokenizer metadata has the kinds and lengths from_gguf_fields reads, so a corrupt
    file is an error naming the key, not an IndexError or a vocabulary of single letters."""

    def bad(key: str, expected: str) -> ValueError:
        value = fields[key]
        shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:80]
        return ValueError(
            f"{where} has {key} = {shown}, expected {expected}: the tokenizer metadata is "
            "corrupt; re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )

    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{where} has no tokenizer.ggml.tokens: it carries no tokenizer")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad("tokenizer.ggml.tokens", "a non-empty list of strings")
    n = len(tokens)
    for key, kind, expected in (
        ("tokenizer.ggml.token_type", int, f"a list of {n} integers, one per token"),
        ("tokenizer.ggml.scores", (int, float), f"a list of {n} numbers, one per token"),
    ):
        value = fields.get(key)
        if value is not None and not (
            isinstance(value, list) and len(value) == n and all(isinstance(v, kind) for v in value)
        ):
            raise bad(key, expected)
    merges = fields.get("tokenizer.ggml.merges")
    if merges is not None and not (
        isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)
    ):
        raise bad("tokenizer.ggml.merges", "a list of 'left right' strings")
    for name in _GGUF_TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        value = fields.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < n):
            raise bad(key, f"a token id in 0..{n - 1}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise bad(key, "a string")


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Normal tokens are stored in the byte alphabet already; respell any stored as raw text.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    if pre not in _BPE_PRE:
        logger.warning("GGUF tokenizer.ggml.pre=%r is unknown: splitting text like GPT-2", pre)
    splits = _BPE_PRE.get(pre, _BPE_PRE["gpt2"])
    model = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=pre in _LLAMA3_LIKE,
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], types: list[int], fields: dict[str, Any], add_space: bool
) -> tokenizers.Tokenizer:
    """llama.cpp's SPM tokenizer as BPE: merges are given or ranked by the merged token's score
    (SPM merges the best-scoring pair first); bytes missing from the vocabulary fall back to
    <0xNN> tokens; a space is prepended to each run of text between special tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if fields.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    else:
        scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        ranked = sorted(
            (-scores[i], vocab[t[:k]], vocab[t[k:]], t[:k], t[k:])
            for i, t in enumerate(tokens)
            if types[i] == 1
            for k in range(1, len(t))
            if t[:k] in vocab and t[k:] in vocab
        )
        merges = [(left, right) for *_, left, right in ranked]
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    steps = [normalizers.Prepend("▁")] if add_space else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], where: str
) -> None:
    """CONTROL tokens become special tokens, USER_DEFINED ones added tokens, each keeping the id
    the file gives it (the content is found in the vocabulary, so no new id is made)."""
    before = backend.get_vocab_size(with_added_tokens=True)
    pairs = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in pairs if k == _USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    if backend.get_vocab_size(with_added_tokens=True) != before:
        grown = [t.content for t in control + user if backend.token_to_id(t.content) >= before]
        raise ValueError(
            f"{where} has special tokens {grown[:5]} that are not in its own vocabulary under the "
            f"same spelling: the tokenizer metadata is inconsistent; use the model's HF directory"
        )
