"""ChoiceText: one choice's output text split into reasoning, content and tool calls, fed delta
by delta (streaming) or all at once, with the same result either way up to whitespace at the
markers.

    feed(delta) -> (reasoning delta, content delta)   content stops at a tool-call marker
    finish()    -> (reasoning rest, content rest, tool calls)
"""

from __future__ import annotations

from outrider.server.parsers.base import (
    ReasoningParser,
    ToolCall,
    ToolParser,
    partial_suffix_len,
)


class ChoiceText:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning.stream() if reasoning is not None else None
        self._tools = tools
        self._content = ""  # all content so far (tool section included)
        self._sent = 0  # characters of _content already returned
        self._in_tools = False  # the tool-call marker appeared: hold everything after it

    def feed(self, delta: str) -> tuple[str, str]:
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(delta)
        else:
            reasoning, content = "", delta
        return reasoning, self._take(content)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning = content = ""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
        self._content += content
        if self._tools is not None:
            extracted = self._tools.extract(self._content)
            if extracted.tool_calls:
                # Content before the marker was streamed already; send what was held back of it.
                before = self._content[: self._content.find(self._tools.start_marker)]
                rest = before[self._sent :]
                return reasoning, rest.rstrip() if rest.strip() else "", extracted.tool_calls
        rest, self._sent = self._content[self._sent :], len(self._content)
        return reasoning, rest, []

    def _take(self, content: str) -> str:
        self._content += content
        if self._tools is None:
            out, self._sent = self._content[self._sent :], len(self._content)
            return out
        if self._in_tools:
            return ""
        marker = self._tools.start_marker
        at = self._content.find(marker, max(0, self._sent - len(marker)))
        if at >= 0:
            self._in_tools = True
            end = at
        else:
            end = len(self._content) - partial_suffix_len(self._content, marker)
        end = max(end, self._sent)
        out, self._sent = self._content[self._sent : end], end
        return out
