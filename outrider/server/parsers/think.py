"""`<think>...</think>` reasoning, as Qwen3 and DeepSeek-R1 write it.

implicit_start False (Qwen3): reasoning only when the output opens with <think>;
implicit_start True (DeepSeek-R1, whose template writes <think> into the prompt): everything
up to </think> is reasoning, and an output without </think> is all reasoning (cut short).

    "<think>2+2 is 4</think>\n\nThe answer is 4." -> ("2+2 is 4", "The answer is 4.")
"""

from __future__ import annotations

from outrider.server.parsers.base import (
    ReasoningParser,
    ReasoningStream,
    none_if_blank,
    partial_suffix_len,
)

START, END = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    def __init__(self, implicit_start: bool = False) -> None:
        self.implicit_start = implicit_start

    def extract(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START) :]
        elif not self.implicit_start:
            return None, none_if_blank(text)
        reasoning, sep, content = body.partition(END)
        if not sep:
            return none_if_blank(reasoning), None
        return none_if_blank(reasoning), none_if_blank(content)

    def stream(self) -> ReasoningStream:
        return _ThinkStream(self.implicit_start)


class _ThinkStream(ReasoningStream):
    """States: "start" (deciding whether <think> opens the output), "reasoning", "content".
    Text that may still become a marker stays in `_buf`; whitespace around the markers is
    dropped as in extract()."""

    def __init__(self, implicit_start: bool) -> None:
        self._implicit = implicit_start
        self._state = "start"
        self._buf = ""
        self._content_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if len(head) < len(START) and START.startswith(head):
                return "", ""  # may still become <think>
            if head.startswith(START):
                self._state, self._buf = "reasoning", head[len(START) :].lstrip()
            else:
                self._state = "reasoning" if self._implicit else "content"
        if self._state == "reasoning":
            end = self._buf.find(END)
            if end < 0:
                hold = partial_suffix_len(self._buf, END)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - hold],
                    self._buf[len(self._buf) - hold :],
                )
                return reasoning, ""
            reasoning, self._buf = self._buf[:end].rstrip(), self._buf[end + len(END) :]
            self._state = "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
            if not self._content_started:
                content = content.lstrip()
                self._content_started = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "start" and self._implicit):
            return rest.rstrip(), ""
        if self._state == "start":  # a prefix of <think> and nothing more: it was content
            return "", rest if self._content_started else rest.lstrip()
        return "", rest
