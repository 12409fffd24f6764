"""Conversation and prompt files in the layouts datasets come in (ShareGPT's from/value turns,
role/content `messages` or `conversations`, plain prompts; JSON or JSONL), read by one function
for `drafter datagen --user-file`, `drafter train --data` and `bench serve --dataset sharegpt`.
Plain Python: the benchmark client imports it without torch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACCEPTED = (
    'a prompt string; {"prompt": str}; {"text": str}; {"conversations": [turn, ...]} or '
    '{"messages": [turn, ...]}, a turn being ShareGPT\'s {"from": "human"|"gpt"|"system", '
    '"value": str} or {"role": "user"|"assistant"|"system", "content": str}; as a JSON list '
    "of records or JSONL, one record a line"
)
ROLES = {  # spellings seen in ShareGPT dumps and chat datasets -> the chat template's roles
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
}  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    id: str  # the record's own "id", else its number in the file (from 1)
    messages: tuple[dict[str, str], ...]  # {"role": "system"|"user"|"assistant", "content"}

    @property
    def system(self) -> str | None:
        return next((m["content"] for m in self.messages if m["role"] == "system"), None)

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user" and m["content"].strip()]


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every record of a conversation or prompt file in any ACCEPTED shape, normalized. A record
    it cannot read raises a ValueError naming the file, the line (JSONL) or record (JSON list)
    and the accepted shapes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: pass an existing JSON or JSONL file")
    out = []
    for where, n, rec in _records(path):
        try:
            messages = conversation_messages(rec)
        except ValueError as e:
            raise ValueError(f"{path}: {where}: {e}; accepted records: {ACCEPTED}") from None
        own = rec.get("id") if isinstance(rec, dict) else None
        out.append(Conversation(str(own if isinstance(own, (str, int)) else n), tuple(messages)))
    return out


def conversation_messages(rec: Any) -> list[dict[str, str]]:
    """One record in any ACCEPTED shape -> [{"role", "content"}] with the chat template's role
    names. Raises ValueError saying what does not fit."""
    if isinstance(rec, str):
        return [{"role": "user", "content": rec}]
    if not isinstance(rec, dict):
        raise ValueError(f"a JSON {_kind(rec)} is not a record")
    for key in ("conversations", "messages"):  # before "prompt": some sets repeat it in these
        if key in rec:
            turns = rec[key]
            if not isinstance(turns, list):
                raise ValueError(f'"{key}" is a JSON {_kind(turns)}, not a list of turns')
            return [_turn(t, f"{key}[{i}]") for i, t in enumerate(turns)]
    for key in ("prompt", "text"):
        if isinstance(rec.get(key), str):
            return [{"role": "user", "content": rec[key]}]
    raise ValueError(f"no prompt, text, messages or conversations among its keys {sorted(rec)[:8]}")


def _turn(turn: Any, where: str) -> dict[str, str]:
    if not isinstance(turn, dict):
        raise ValueError(f"{where} is a JSON {_kind(turn)}, not a turn object")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLES:
        raise ValueError(f"{where} has role {role!r}; roles read: {', '.join(ROLES)}")
    if isinstance(content, list):  # OpenAI content parts: the text ones, joined
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ValueError(f"{where} has non-text content parts; only text is read")
        content = "\n".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise ValueError(f"{where} has content {content!r}, not a string")
    return {"role": ROLES[role.lower()], "content": content}


def _kind(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """(number, line) of a JSONL text as read_text gives it (CRLF and CR made LF), broken at LF
    and nowhere else: str.splitlines also breaks at U+2028 and U+0085, which JSON strings may
    hold raw (json.dumps with ensure_ascii=False writes them so)."""
    return enumerate(text.split("\n"), 1)


def _records(path: Path) -> list[tuple[str, int, Any]]:
    """(where, number, record) for each record: a JSON list's items, one JSON value (a
    pretty-printed object, say), or a JSONL file's lines."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):
            raise ValueError(
                f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): fix "
                f"it, or write one record a line (JSONL)"
            ) from None
    else:
        if isinstance(whole, list):
            return [(f"record {i}", i, rec) for i, rec in enumerate(whole, 1)]
        # One value: a JSONL file of one line, or one pretty-printed record.
        first = next(n for n, line in _lines(text) if line.strip())
        return [(f"line {first}", first, whole)]
    out = []
    for n, line in _lines(text):
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", n, json.loads(line)))
        except json.JSONDecodeError:
            raise ValueError(
                f"{path}: line {n} is not valid JSON: fix or delete that line (accepted records: "
                f"{ACCEPTED})"
            ) from None
    return out
