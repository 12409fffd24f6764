"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call, possibly several, after optional plain text:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
-> content "Let me check.", one call get_weather('{"city": "Paris"}').
A final block missing its `</tool_call>` (generation stopped at it) is still read. A forced
call (`call_grammar`) is written the way the template writes one: the name and the `"arguments"`
key fixed, the arguments a JSON value of the tool's schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from outrider.server.parsers.base import (
    ExtractedTools,
    ToolCall,
    ToolParser,
    ToolSchema,
    lark_json,
    lark_text,
    none_if_blank,
)

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

    def call_grammar(self, tools: Sequence[ToolSchema], several: bool) -> str:
        rules = ['start: call ("\\n"? call)*' if several else "start: call"]
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        for i, tool in enumerate(tools):
            head = f'<tool_call>\n{{"name": {json.dumps(tool.name)}, "arguments": '
            tail = "}\n</tool_call>"
            rules.append(
                f"call_{i}: {lark_text(head)} {lark_json(tool.parameters)} {lark_text(tail)}"
            )
        return "\n".join(rules)


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
