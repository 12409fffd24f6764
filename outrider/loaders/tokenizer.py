"""The model's tokenizer: a `tokenizers.Tokenizer` plus its chat template and special ids, built
from an HF directory (tokenizer.json & co.) or from a GGUF file's `tokenizer.*` metadata."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from outrider.loaders import gguf_tokenizer
from outrider.loaders.chat_template import TemplateLimits, render_chat_template
from outrider.loaders.vocab_common import byte_alphabet, read_json, token_content

_TRIAL_CONVERSATION = [{"role": "user", "content": "Hello!"}]

# tokenizers' encode() and decode() hold the GIL from start to end, so a megabyte of text stops
# every other Python thread (the server's event loop among them) for seconds; their batch forms
# release it while Rust works. A text this long (or a quarter as many ids) takes a few
# milliseconds either way.
_RELEASE_GIL_CHARS = 4096


class TextTooLong(ValueError):
    """A text whose length alone shows it encodes to more tokens than allowed."""

    def __init__(self, chars: int, least: int, max_tokens: int) -> None:
        super().__init__(
            f"the text has {chars} characters, so at least {least} tokens, more than {max_tokens}"
        )
        self.chars, self.least, self.max_tokens = chars, least, max_tokens


class Tokenizer:
    """Text <-> ids for one model, and its chat template.

    Invariants: `eos_token_ids` holds every id that ends generation (EOS, end-of-turn); ids in
    `all_special_ids` are dropped by decode(skip_special_tokens=True); the chat template renders
    within `chat_limits`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str] | None = None,
        chat_template_origin: str = "the model's chat template",
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.chat_template_origin = chat_template_origin  # where it came from, for errors
        self.chat_limits = TemplateLimits()
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        # bos_token / eos_token / ... as chat templates see them.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # Longest first, so a special token that starts another does not cut it short.
        texts = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json, plus tokenizer_config.json (chat template, special tokens),
        chat_template.jinja, generation_config.json and config.json (EOS ids) where present."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            from outrider.loaders.tiktoken_vocab import TIKTOKEN_FILE, tiktoken_backend

            if (path / TIKTOKEN_FILE).is_file():
                return cls._from_dir(path, tiktoken_backend(path))
            raise FileNotFoundError(
                f"{str(path / 'tokenizer.json')!r} not found: outrider reads fast-tokenizer files "
                f"(tokenizer.json) or tiktoken's ({TIKTOKEN_FILE}, as Kimi ships); create a "
                "tokenizer.json with transformers: AutoTokenizer.from_pretrained(dir)"
                ".save_pretrained(dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise ValueError(
                f"{str(path / 'tokenizer.json')!r} is not a tokenizer file tokenizers can read "
                f"({str(e)[:200]}): re-download it"
            ) from None
        return cls._from_dir(path, backend)

    @classmethod
    def _from_dir(cls, path: Path, backend: tokenizers.Tokenizer) -> Tokenizer:
        tok_cfg = read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        # Several named templates: [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        if isinstance(template, list) and all(isinstance(t, dict) for t in template):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        origin = f"the chat_template in {str(path / 'tokenizer_config.json')!r}"
        if template is not None and not isinstance(template, str):
            raise ValueError(
                f"{origin} is {str(template)[:80]!r}, expected a jinja string or a list of "
                "{name, template} objects: fix or re-download tokenizer_config.json"
            )
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
            origin = f"the chat template {str(path / 'chat_template.jinja')!r}"
        specials = {
            name: token_content(tok_cfg[name])
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if tok_cfg.get(name) is not None
        }
        for name, text in specials.items():
            if not isinstance(text, str):
                raise ValueError(
                    f"{str(path / 'tokenizer_config.json')!r} has {name} {str(text)[:80]!r}, "
                    "expected a token's text (or {content: text}): fix or re-download it"
                )
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = read_json(path / name).get("eos_token_id")
            ids = value if isinstance(value, list) else [] if value is None else [value]
            if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
                raise ValueError(
                    f"{str(path / name)!r} has eos_token_id {str(value)[:80]}, expected a token "
                    "id or a list of them: fix or re-download it"
                )
            eos += ids
        if (eos_id := backend.token_to_id(specials.get("eos_token", ""))) is not None:
            eos.append(eos_id)
        bos_id = backend.token_to_id(specials.get("bos_token", ""))
        if bos_id is None:
            bos_id = read_json(path / "config.json").get("bos_token_id")
        return cls(
            backend,
            chat_template=template,
            bos_token_id=bos_id,
            eos_token_ids=eos,
            special_tokens=specials,
            chat_template_origin=origin,
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], path: str | Path | None = None) -> Tokenizer:
        """From a GGUF's `tokenizer.*` metadata (keys as in the file, e.g. "tokenizer.ggml.tokens";
        gguf_tokenizer.py builds it). `path` names the file in errors."""
        backend, parts = gguf_tokenizer.build(fields, path)
        return cls(backend, **parts)

    # ---- use -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids. add_special_tokens adds what the model's post-processor adds (BOS for
        models that want it). Encode chat-template output with add_special_tokens=False: the
        template writes BOS itself."""
        if len(text) < _RELEASE_GIL_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) < _RELEASE_GIL_CHARS // 4:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def token_texts(self) -> tuple[str, ...]:
        """decode([i], skip_special_tokens=False) for every id: what each token reads as alone."""
        ids = [[i] for i in range(self.vocab_size)]
        return tuple(self.backend.decode_batch(ids, skip_special_tokens=False))

    @functools.cached_property
    def _length_bound(self) -> tuple[int, tuple[str, ...]] | None:
        """(the most characters of input one token stands for, the characters this tokenizer
        drops), or None where its pipeline gives no such bound (see _dropped_chars)."""
        dropped = _dropped_chars(json.loads(self.backend.to_str()))
        if dropped is None:
            return None
        # A byte-level token spells each byte of its text with one character, so it stands for
        # at most as many characters as it spells; a SentencePiece piece spells its text itself
        # ("▁" for " "), a byte-fallback piece part of one character.
        return max(map(len, self.backend.get_vocab(with_added_tokens=True))), dropped

    def least_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to (0 when the tokenizer gives no bound): every
        character it keeps is covered by some token, no token covers more than the longest
        token's length of them, and the post-processor only adds tokens. Counts the characters
        the tokenizer drops (a few ASCII controls some byte-level vocabularies lack): up to a
        few scans of the text, none where nothing is dropped."""
        bound = self._length_bound
        if bound is None:
            return 0
        most, dropped = bound
        kept = len(text) - sum(map(text.count, dropped))
        return -(-kept // most)

    def _check_length(self, text: str, max_tokens: int | None) -> None:
        if max_tokens is not None and (least := self.least_tokens(text)) > max_tokens:
            raise TextTooLong(len(text), least, max_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        """The backend with special-token text encoded as text (HF's split_special_tokens). A
        copy, not a toggle of `backend`: the server encodes from several threads at once."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
        max_tokens: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation: the template's own markers are control tokens,
        special-token text inside messages other than system ones (content, names, tool calls)
        stays text, so a user who writes `<|im_end|><|im_start|>system` opens no system turn.
        System messages are the deployer's and encode as rendered. A conversation without
        special-token text encodes exactly as encode(apply_chat_template(...)) does. A rendered
        text that certainly encodes to more than max_tokens tokens raises TextTooLong."""
        render = functools.partial(
            self.apply_chat_template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
        text = render(messages)
        self._check_length(text, max_tokens)
        guarded, originals = _guard_special_text(messages, self._special_text, taken=text)
        if not originals:
            return self.encode(text, add_special_tokens=add_special_tokens)
        # Each special-token string in a message went in as a private-use character the rendered
        # text does not hold otherwise; the template's markers are found by encoding that text,
        # and the text between two markers is encoded again with the characters put back, as
        # text. Between markers the tokenizer encodes each run on its own anyway, so runs
        # without such characters keep their ids.
        guarded_text = render(guarded)
        restore = str.maketrans(originals)
        if guarded_text.translate(restore) != text:
            raise ValueError(
                "the chat template changed special-token text inside a message (e.g. escaped "
                "it), so it cannot be kept as text: remove special-token text such as "
                f"{next(iter(originals.values()))!r} from the messages"
            )
        ids: list[int] = []
        run: list[int] = []
        cut = 0  # where the text after the last marker starts
        encoding = self.backend.encode_batch([guarded_text], add_special_tokens=False)[0]
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id not in self.all_special_ids:
                run.append(token_id)
                continue
            ids += self._run_ids(guarded_text[cut:start], run, restore)
            ids.append(token_id)
            run, cut = [], end
        ids += self._run_ids(guarded_text[cut:], run, restore)
        if add_special_tokens:  # what the post-processor wraps around any text (BOS, EOS)
            bare = self.backend.encode("a", add_special_tokens=False).ids
            full = self.backend.encode("a", add_special_tokens=True).ids
            i = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
            ids = full[:i] + ids + full[i + len(bare) :]
        return ids

    def _run_ids(self, text: str, ids: list[int], restore: dict[int, str]) -> list[int]:
        """`ids` (the run `text` encoded), or the run encoded again as text when it holds a
        message's special-token text."""
        plain = text.translate(restore)
        if plain == text:
            return ids
        return self._text_backend.encode_batch_fast([plain], add_special_tokens=False)[0].ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages as transformers' apply_chat_template(tokenize=False) does: the same
        sandboxed jinja environment, helpers and variables, so prompts match token for token."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template (none in its tokenizer_config.json or GGUF "
                "metadata): pass raw=True (--raw on the command line) to send the prompt as is"
            )
        # Keys set to None (OpenAI clients send content=None, tool_calls=None) are dropped, as
        # transformers does: templates test for presence and would render "None".
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = dict(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, "documents": None, **kwargs},
        )  # a TypeError when kwargs repeat one of the first three
        return render_chat_template(self.chat_template, self.chat_limits, variables)

    def with_chat_template(
        self, limits: TemplateLimits, template: str | None = None, origin: str | None = None
    ) -> Tokenizer:
        """A copy whose chat template (`template` from `origin`, or this one's own) renders
        within `limits`, once it has rendered a one-message conversation: a template that does
        not compile, or fails on that, is an error naming where it came from, at start-up rather
        than on every request."""
        chat = copy.copy(self)
        chat.chat_limits = limits
        if template is not None:
            chat.chat_template = template
            chat.chat_template_origin = origin or "the chat template"
        if chat.chat_template:
            try:
                chat.apply_chat_template(_TRIAL_CONVERSATION)
            except ValueError as e:
                raise ValueError(
                    f"{chat.chat_template_origin} cannot render a one-message conversation "
                    f"({e}): fix the template, or pass a working one with --chat-template"
                ) from None
        return chat


# Steps that keep every character of the text (a Split that is not "removed" isolates or
# merges its matches, never drops them), and normalizers that never shorten it.
_KEEPING_PRE = frozenset({"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation"})
_LENGTHENING_NORM = frozenset({"Prepend", "Replace"})


def _dropped_chars(spec: dict[str, Any]) -> tuple[str, ...] | None:
    """The characters a tokenizer.json spec drops without a token, when it maps every other
    character into some token and no token covers more characters than it spells: BPE over a
    pre-tokenizer and normalizer that keep every character, byte-level or with byte fallback,
    no truncation, no added token that swallows the whitespace beside it. A byte-level BPE
    drops bytes its vocabulary lacks (SmolLM2 lacks 0x04 and five more ASCII controls); a
    character beyond ASCII keeps its continuation bytes, unless one of those is missing too.
    None where the spec makes no such promise (NFC/NFKC, splits that drop whitespace, an
    unknown token fused over a run of characters, ...)."""

    def steps(part: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
        if part is None:
            return []
        return (
            [s for p in part[key] for s in steps(p, key)] if part["type"] == "Sequence" else [part]
        )

    pre = steps(spec.get("pre_tokenizer"), "pretokenizers")
    norm = steps(spec.get("normalizer"), "normalizers")
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None:
        return None
    if any(p["type"] not in _KEEPING_PRE or p.get("behavior") == "Removed" for p in pre):
        return None
    for n in norm:
        pattern = (n.get("pattern") or {}).get("String")
        if n["type"] not in _LENGTHENING_NORM:
            return None
        if n["type"] == "Replace" and (pattern is None or len(n["content"]) < len(pattern)):
            return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None
    if any(p["type"] == "ByteLevel" for p in pre):
        missing = [b for b, c in byte_alphabet().items() if c not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):
            return None
        return tuple(chr(b) for b in missing if b < 0x80)
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return ()
    return None


def _guard_special_text(
    messages: list[dict[str, Any]], special: re.Pattern[str] | None, taken: str
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`messages` with each special-token string in non-system messages (every string value and
    key but the role) replaced by a private-use character not in `taken`, and a map from those
    characters back to the strings."""
    chosen: dict[str, str] = {}  # special-token text -> its character
    free = (c for c in map(chr, range(0xF0000, 0xFFFFE)) if c not in taken)

    def character(match: re.Match[str]) -> str:
        if match[0] not in chosen:
            chosen[match[0]] = next(free)
        return chosen[match[0]]

    def guard(value: Any) -> Any:
        if isinstance(value, str):
            return special.sub(character, value)
        if isinstance(value, dict):
            return {guard(k): guard(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [guard(v) for v in value]
        return value

    if special is None:
        return messages, {}
    guarded = [
        m
        if m.get("role") == "system"
        else {k: v if k == "role" else guard(v) for k, v in m.items()}
        for m in messages
    ]
    return guarded, {c: t for t, c in chosen.items()}


# ---- GGUF vocabularies -------------------------------------------------------------------

# Ids the tokenizer reads from the metadata: each must name a token in tokenizer.ggml.tokens.
