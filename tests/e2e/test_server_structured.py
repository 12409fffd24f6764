"""Structured outputs through a live `outrider serve` (the real default model, fp32 on CPU) and
the official `openai` client: response_format (and the client's parse() into a pydantic model),
vLLM's structured_outputs and guided_* fields, SGLang's regex, ebnf and json_schema, forced tool
calls (tool_choice "required" or a named function, read back by the hermes parser), and
constraints that do not compile answered with a 400 naming the field. Small schemas and greedy
decoding: the engine ends a request when its grammar is complete, well inside max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_server_openai import HERMES_TEMPLATE

pytestmark = pytest.mark.slow

KEY = "sk-structured-test"
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON: its name and its population."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]
# Bounded strings and numbers, no extra properties: a 135M model held to a schema with room to
# go on (an unbounded integer, more properties) may write digits or keys until max_tokens.
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}


def _tool(name: str, description: str, argument: str) -> dict:
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string", "maxLength": 32}},
        "required": [argument],
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


WEATHER_TOOL = _tool("get_weather", "Current weather for a city.", "city")
TIME_TOOL = _tool("get_time", "The local time in a timezone.", "timezone")
TOOL_SCHEMAS = {
    t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)
}
SHORT = dict(max_tokens=200, temperature=0)


class City(BaseModel):
    name: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    template = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    core = EngineCore(EngineConfig().replace(model={"dtype": "float32", "device": "cpu"}))
    config = ServerConfig(api_key=KEY, tool_parser="hermes", chat_template=str(template))
    with ServerThread(config, core) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_name


def test_response_format_json_schema_whole_and_streamed(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(model=model, messages=ASK_CITY, response_format=fmt, **SHORT)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert r.choices[0].finish_reason == "stop"
    assert list(json.loads(text)) == ["name", "population"]  # the schema's order
    chunks = client.chat.completions.create(
        model=model, messages=ASK_CITY, response_format=fmt, stream=True, **SHORT
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_parse_returns_the_pydantic_object(client, model):
    r = client.beta.chat.completions.parse(
        model=model, messages=ASK_CITY, response_format=City, **SHORT
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_response_format_json_object(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK_CITY, response_format={"type": "json_object"}, **SHORT
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


CHOICES = ["yes", "no"]
THREE_DIGITS = r"[0-9]{3}"


def _choice(text: str) -> None:
    assert text in CHOICES, text


def _digits(text: str) -> None:
    assert re.fullmatch(THREE_DIGITS, text), text


def _city(text: str) -> None:
    jsonschema.validate(json.loads(text), CITY)


EXTRAS = [  # extra body -> check of the output text
    ({"structured_outputs": {"choice": CHOICES}}, _choice),
    ({"structured_outputs": {"regex": THREE_DIGITS}}, _digits),
    ({"structured_outputs": {"json": CITY, "disable_any_whitespace": True}}, _city),
    ({"guided_choice": CHOICES}, _choice),
    ({"guided_regex": THREE_DIGITS}, _digits),
    ({"guided_json": CITY}, _city),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, _choice),
    ({"regex": THREE_DIGITS}, _digits),
    ({"ebnf": 'root ::= "yes" | "no"'}, _choice),
    ({"json_schema": json.dumps(CITY)}, _city),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
        _city,
    ),
]
EXTRA_IDS = [
    ".".join([field, *(value if field == "structured_outputs" else [])])
    for field, value in (next(iter(extra.items())) for extra, _ in EXTRAS)
]


@pytest.mark.parametrize(("extra", "check"), EXTRAS, ids=EXTRA_IDS)
def test_vllm_and_sglang_fields_on_chat(client, model, extra, check):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is Paris in France? Answer, then say why."}],
        extra_body=extra,
        **SHORT,
    )
    check(r.choices[0].message.content)


@pytest.mark.parametrize(("extra", "check"), EXTRAS, ids=EXTRA_IDS)
def test_vllm_and_sglang_fields_on_completions(client, model, extra, check):
    r = client.completions.create(
        model=model, prompt="The number of days in a year is", extra_body=extra, **SHORT
    )
    check(r.choices[0].text)


def _calls_are_valid(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_a_named_tool_choice_is_a_call_of_that_function(client, model):
    kw = dict(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **SHORT,
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _calls_are_valid(choice.message.tool_calls, {"get_time"})
    assert len(choice.message.tool_calls) == 1
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_time"]
    assert streamed[0].function.arguments == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_is_a_call_of_one_of_the_tools(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        **SHORT,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _calls_are_valid(choice.message.tool_calls, set(TOOL_SCHEMAS))
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"guided_json": {"type": "objectt"}}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            },
            "response_format",
        ),
        ({"guided_grammar": 'start: ("a"'}, "guided_grammar"),
        ({"ebnf": "root ::= ("}, "ebnf"),
    ],
)
def test_a_constraint_that_does_not_compile_is_400_and_the_server_serves_on(
    client, model, extra, param
):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK_CITY, extra_body=extra, max_tokens=4
        )
    assert info.value.body["param"] == param, info.value.body
    assert param in info.value.body["message"]
    r = client.chat.completions.create(model=model, messages=ASK_CITY, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
