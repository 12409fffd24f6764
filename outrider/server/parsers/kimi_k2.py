"""Kimi-K2 tool calls, written with special tokens:

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_calls_section_end|>
-> one call get_weather('{"city": "Paris"}') whose id is "functions.get_weather:0" (Kimi's
own id form, which its chat template expects back in tool messages).
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

_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)\s*<\|tool_call_end\|>",
    re.DOTALL,
)


class KimiK2ToolParser(ToolParser):
    start_marker = _SECTION_BEGIN[0]
    needs_special_tokens = True

    def extract(self, text: str) -> ExtractedTools:
        starts = [i for i in (text.find(m) for m in _SECTION_BEGIN) if i >= 0]
        if not starts:
            return ExtractedTools(content=none_if_blank(text), tool_calls=[])
        start = min(starts)
        section = text[start:]
        calls = []
        for m in _CALL.finditer(section):
            call = _parse_call(m.group("id"), m.group("args"))
            if call is None:
                return ExtractedTools(content=none_if_blank(text), tool_calls=[])
            calls.append(call)
        if not calls or section.count("<|tool_call_begin|>") != len(calls):
            return ExtractedTools(content=none_if_blank(text), tool_calls=[])
        return ExtractedTools(content=none_if_blank(text[:start]), tool_calls=calls)

    def call_grammar(self, tools: Sequence[ToolSchema], several: bool) -> str:
        # The markers are special tokens: `<|name|>` in the grammar, never their text.
        rules = [
            "start: <|tool_calls_section_begin|> "
            + ("call+" if several else "call")
            + " <|tool_calls_section_end|>",
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            rules.append(
                f"call_{i}: <|tool_call_begin|> {lark_text(f'functions.{tool.name}:')} /[0-9]+/ "
                f"<|tool_call_argument_begin|> {lark_json(tool.parameters)} <|tool_call_end|>"
            )
        return "\n".join(rules)


def _parse_call(call_id: str, args_text: str) -> ToolCall | None:
    # "functions.get_weather:0" -> "get_weather"; the index after the last ':' numbers calls.
    name = call_id.rsplit(":", 1)[0].removeprefix("functions.").strip()
    if not name:
        return None
    try:
        args = json.loads(args_text.strip())
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False), id=call_id.strip())
