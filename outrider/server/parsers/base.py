"""The parser interfaces: what a tool-call parser and a reasoning parser promise the server.

Both read the model's generated text only (never the prompt), never raise on model output,
and never lose text: whatever is not a well-formed tool call or reasoning span comes back as
content.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI's function.arguments carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ExtractedTools:
    content: str | None  # text outside the calls; None when there is none
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolSchema:
    """A function the output may call: its name and the JSON schema of its arguments object."""

    name: str
    parameters: dict


class ToolParser(ABC):
    """Finds tool calls in a finished output, and says what output is nothing but calls.

    Invariants: `extract` never raises; when any call in the text is malformed, it returns the
    whole text as content and no calls (a half-parsed answer is worse than plain text).
    `start_marker` is the text that opens a call section: streaming sends content up to it and
    holds everything after it back until the output ends. `needs_special_tokens` is true when
    the markers are special tokens, which the detokenizer must then keep. Every text
    `call_grammar(tools, several)` accepts, `extract` reads back as calls only (no content):
    one call (one or more when `several`), each naming one of `tools`, its arguments valid
    against that tool's parameters. It is what tool_choice "required" or a named function
    constrains the output to.
    """

    start_marker: str
    needs_special_tokens: bool = False

    @abstractmethod
    def extract(self, text: str) -> ExtractedTools: ...

    @abstractmethod
    def call_grammar(self, tools: Sequence[ToolSchema], several: bool) -> str:
        """A Lark grammar in llguidance's dialect (`%json {schema}` for a JSON value,
        `<|name|>` for a special token)."""


class ReasoningParser(ABC):
    """Splits an output into reasoning (`reasoning_content`) and the answer (`content`).

    Invariant: reasoning + content hold all of the text except the markers themselves and
    whitespace next to them; `stream()` returns a fresh incremental splitter whose deltas
    concatenate to what `extract` returns for the same text.
    """

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]: ...

    @abstractmethod
    def stream(self) -> ReasoningStream: ...


class ReasoningStream(ABC):
    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for new text; may hold a possible marker back."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """Whatever was held back, once the output has ended."""


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`: the part a
    stream must hold back because the next delta may complete the marker.
    partial_suffix_len("abc<tool", "<tool_call>") == 5."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def lark_text(text: str) -> str:
    """`text` as a Lark string literal: JSON's escapes are Lark's."""
    return json.dumps(text)


def lark_json(schema: dict) -> str:
    """A JSON value valid against `schema`, as a Lark grammar item. The schema stays the root
    of its own `%json`, so its `$ref`s ("#/$defs/...") resolve as the client wrote them."""
    return "%json " + json.dumps(schema)


def none_if_blank(text: str) -> str | None:
    text = text.strip()
    return text or None
