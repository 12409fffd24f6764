"""Tool-call and reasoning parsers on fake model outputs, whole and streamed in pieces."""

from __future__ import annotations

import json

import pytest

from outrider.server.choice_text import ChoiceText
from outrider.server.parsers.base import partial_suffix_len
from outrider.server.parsers.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    build_reasoning_parser,
    build_tool_parser,
)

HERMES_TWO = (
    "Checking both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
KIMI_TWO = (
    "Let me look.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
    '{"tz": "UTC"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


def test_registry_builds_every_name_and_refuses_unknown():
    for name in TOOL_PARSERS:
        assert build_tool_parser(name).start_marker
    for name in REASONING_PARSERS:
        assert build_reasoning_parser(name).extract("x") is not None
    with pytest.raises(ValueError, match="unknown tool parser 'nope'.*hermes"):
        build_tool_parser("nope")


def test_hermes_two_calls_and_content():
    out = build_tool_parser("hermes").extract(HERMES_TWO)
    assert out.content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    ],
)
def test_hermes_malformed_stays_content(text):
    out = build_tool_parser("hermes").extract(text)
    assert out.tool_calls == [] and out.content == text


def test_hermes_unterminated_and_string_arguments():
    out = build_tool_parser("qwen").extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert out.content is None
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": 1}')]


def test_kimi_k2_two_calls_keep_their_ids():
    parser = build_tool_parser("kimi_k2")
    assert parser.needs_special_tokens
    out = parser.extract(KIMI_TWO)
    assert out.content == "Let me look."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}),
        ("functions.get_time:1", "get_time", {"tz": "UTC"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "plain",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{bad}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_calls_section_end|>",
    ],
)
def test_kimi_k2_malformed_stays_content(text):
    out = build_tool_parser("kimi_k2").extract(text)
    assert out.tool_calls == [] and out.content == text


def test_think_extract():
    think = build_reasoning_parser("think")
    assert think.extract("<think>2+2 is 4</think>\n\nThe answer is 4.") == (
        "2+2 is 4",
        "The answer is 4.",
    )
    assert think.extract("The answer is 4.") == (None, "The answer is 4.")
    assert think.extract("<think>still thinking") == ("still thinking", None)
    r1 = build_reasoning_parser("deepseek_r1")
    assert r1.extract("2+2 is 4</think>Four.") == ("2+2 is 4", "Four.")
    assert r1.extract("cut short") == ("cut short", None)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("think", "<think>2+2 is 4</think>\n\nThe answer is 4."),
        ("think", "  <think>\nA</think>B"),
        ("think", "<thin is not a tag"),
        ("think", "<think>never closed"),
        ("deepseek_r1", "reason</think>answer"),
        ("deepseek_r1", "</think>answer"),
    ],
)
def test_think_streaming_matches_extract(name, text, size):
    parser = build_reasoning_parser(name)
    stream = parser.stream()
    reasoning = content = ""
    for piece in _pieces(text, size):
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    reasoning, content = reasoning + r, content + c
    want_r, want_c = parser.extract(text)
    assert (reasoning.strip() or None, content.strip() or None) == (want_r, want_c)
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_choice_text_streams_content_and_holds_the_tool_section(size):
    text = "<think>user wants weather</think>" + HERMES_TWO
    split = ChoiceText(build_reasoning_parser("think"), build_tool_parser("hermes"))
    reasoning = content = ""
    for piece in _pieces(text, size):
        r, c = split.feed(piece)
        reasoning, content = reasoning + r, content + c
        assert "<tool_call" not in content and "<tool" not in content
    r, c, calls = split.finish()
    assert (reasoning + r).strip() == "user wants weather"
    assert (content + c).strip() == "Checking both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_choice_text_without_calls_releases_everything():
    split = ChoiceText(None, build_tool_parser("hermes"))
    got = split.feed("a <tool")[1]
    assert got == "a "  # "<tool" may still become "<tool_call>"
    _, rest, calls = split.finish()
    assert got + rest == "a <tool" and calls == []
    split = ChoiceText(None, build_tool_parser("hermes"))
    shown = split.feed("x <tool_call>{broken")[1]
    _, rest, calls = split.finish()
    assert calls == [] and shown + rest == "x <tool_call>{broken"


def test_partial_suffix_len():
    assert partial_suffix_len("abc<tool", "<tool_call>") == 5
    assert partial_suffix_len("abc", "<tool_call>") == 0
    assert partial_suffix_len("<tool_call>", "<tool_call>") == 0  # complete is not partial
