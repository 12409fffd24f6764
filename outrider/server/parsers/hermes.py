"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call, possibly several, after optional plain text:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
-> content "Let me check.", one call get_weather('{"city": "Paris"}').
A final block missing its `</tool_call>` (generation stopped at it) is still read.
"""

from __future__ import annotations

import json
import re

from outrider.server.parsers.base import ExtractedTools, ToolCall, ToolParser, none_if_blank

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    start_marker = "<tool_call>"

    def extract(self, text: str) -> ExtractedTools:
        start = text.find(self.start_marker)
        if start < 0:
            return ExtractedTools(content=none_if_blank(text), tool_calls=[])
        calls = []
        for body in _BLOCK.findall(text, start):
            call = _parse_call(body)
            if call is None:
                return ExtractedTools(content=none_if_blank(text), tool_calls=[])
            calls.append(call)
        return ExtractedTools(content=none_if_blank(text[:start]), tool_calls=calls)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))
