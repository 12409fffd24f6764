"""Parsers by name, imported lazily: a new format adds a file and a line here."""

from __future__ import annotations

import importlib

from outrider.server.parsers.base import ReasoningParser, ToolParser

# name -> (module, class, constructor keyword arguments)
TOOL_PARSERS: dict[str, tuple[str, str, dict]] = {
    "hermes": ("outrider.server.parsers.hermes", "HermesToolParser", {}),
    "qwen": ("outrider.server.parsers.hermes", "HermesToolParser", {}),  # Qwen2.5/3 use Hermes'
    "kimi_k2": ("outrider.server.parsers.kimi_k2", "KimiK2ToolParser", {}),
}
REASONING_PARSERS: dict[str, tuple[str, str, dict]] = {
    # <think>...</think> at the start of the output (Qwen3): without <think> it is all content.
    "think": ("outrider.server.parsers.think", "ThinkReasoningParser", {"implicit_start": False}),
    # The template opens <think> itself (DeepSeek-R1): output is reasoning until </think>.
    "deepseek_r1": (
        "outrider.server.parsers.think",
        "ThinkReasoningParser",
        {"implicit_start": True},
    ),
}


def _build(table: dict[str, tuple[str, str, dict]], kind: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {kind} parser {name!r}: use one of {sorted(table)}")
    module, cls, kwargs = table[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


def build_tool_parser(name: str) -> ToolParser:
    return _build(TOOL_PARSERS, "tool", name)


def build_reasoning_parser(name: str) -> ReasoningParser:
    return _build(REASONING_PARSERS, "reasoning", name)
