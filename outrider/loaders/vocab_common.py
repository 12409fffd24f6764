"""What the tokenizer readers share: GPT-2's byte-level spelling, and reading an HF tokenizer's
JSON files (tokenizer.py builds from tokenizer.json or GGUF, tiktoken_vocab.py from Kimi's
tiktoken.model)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the spelling of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} when there is no such file); anything else in it is an error
    naming the file."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{str(path)!r} is not valid JSON ({e}): re-download it") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{str(path)!r} holds a JSON {type(value).__name__}, not an object: re-download it"
        )
    return value


def token_content(value: str | dict[str, Any]) -> str:
    return value.get("content") if isinstance(value, dict) else value
