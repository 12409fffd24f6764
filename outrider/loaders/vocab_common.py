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
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def token_content(value: str | dict[str, Any]) -> str:
    return value["content"] if isinstance(value, dict) else value
