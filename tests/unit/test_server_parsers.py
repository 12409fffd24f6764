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


# -- forced calls: what call_grammar accepts, extract reads back as calls --------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
KIMI_MARKERS = [
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Every byte a token, Kimi's markers special tokens: any grammar can run over any text."""
    import llguidance
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|eos|>", *KIMI_MARKERS])
    return backend, llguidance.LLTokenizer(
        backend.to_str(), eos_token=backend.token_to_id("<|eos|>")
    )


def accepts(byte_tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` (Lark) takes `text` whole, as llguidance runs it token by token."""
    from llguidance import LLMatcher

    backend, tokenizer = byte_tokenizer
    compiled = LLMatcher.grammar_from_lark(grammar)
    assert LLMatcher.validate_grammar(compiled, tokenizer) == "", grammar
    matcher = LLMatcher(tokenizer, compiled, log_level=0)
    return matcher.consume_tokens(backend.encode(text).ids) and matcher.is_accepting()


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _kimi(name: str, args: str, index: int = 0) -> str:
    return (
        f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}"
        "<|tool_call_end|>"
    )


def _kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


FORCED = {  # parser -> (one call, two calls, a wrong name, arguments off the schema, text first)
    "hermes": (
        _hermes("get_weather", '{"city": "Paris", "days": 2}'),
        _hermes("get_weather", '{"city": "Paris"}') + "\n" + _hermes("get_time", '{"tz": "UTC"}'),
        _hermes("get_wether", '{"city": "Paris"}'),
        _hermes("get_weather", '{"town": "Paris"}'),
        "Sure. " + _hermes("get_weather", '{"city": "Paris"}'),
    ),
    "kimi_k2": (
        _kimi_section(_kimi("get_weather", '{"city": "Paris", "days": 2}')),
        _kimi_section(
            _kimi("get_weather", '{"city": "Paris"}'), _kimi("get_time", '{"tz": "UTC"}', 1)
        ),
        _kimi_section(_kimi("get_wether", '{"city": "Paris"}')),
        _kimi_section(_kimi("get_weather", '{"city": 7}')),
        "Sure. " + _kimi_section(_kimi("get_weather", '{"city": "Paris"}')),
    ),
}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_call_grammar_takes_exactly_the_calls_the_parser_reads(byte_tokenizer, name):
    import jsonschema

    from outrider.server.parsers.base import ToolSchema

    parser = build_tool_parser(name)
    tools = [ToolSchema("get_weather", WEATHER), ToolSchema("get_time", TIME)]
    one, two, wrong_name, wrong_args, text_first = FORCED[name]
    several = parser.call_grammar(tools, several=True)
    single = parser.call_grammar(tools, several=False)
    named = parser.call_grammar(tools[:1], several=False)
    for grammar, text in ((several, one), (several, two), (single, one), (named, one)):
        assert accepts(byte_tokenizer, grammar, text), (grammar, text)
        out = parser.extract(text)
        assert out.content is None and out.tool_calls, text
        for call in out.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]
            jsonschema.validate(json.loads(call.arguments), schema)
    assert not accepts(byte_tokenizer, single, two)
    assert not accepts(byte_tokenizer, named, two)
    for text in (wrong_name, wrong_args, text_first):
        assert not accepts(byte_tokenizer, several, text), text


def test_call_grammar_keeps_the_parameters_schema_whole(byte_tokenizer):
    """$refs resolve against the tool's own schema, and an odd name is written as JSON."""
    from outrider.server.parsers.base import ToolSchema

    refs = {
        "$defs": {"Unit": {"enum": ["C", "F"]}},
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
    }
    name = 'odd "name" é'
    parser = build_tool_parser("hermes")
    grammar = parser.call_grammar([ToolSchema(name, refs)], several=False)
    text = (
        f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {{"unit": "C"}}}}\n</tool_call>'
    )
    assert accepts(byte_tokenizer, grammar, text)
    assert not accepts(byte_tokenizer, grammar, text.replace('"C"', '"K"'))
    [call] = parser.extract(text).tool_calls
    assert call.name == name and json.loads(call.arguments) == {"unit": "C"}
