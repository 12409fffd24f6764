"""Structured outputs in the server without a model: every way OpenAI, vLLM and SGLang clients
ask for one becomes the one StructuredOutputs the engine gets; two at once, or one that cannot be
read, is a 400 naming the field; an engine refusing a constraint is a 400 naming the request's
field and the server serves on; a forced tool call comes back as tool_calls. The engine's
enforcing is not needed here: a scripted core records what it was given and says what it is
told to (tests/e2e/test_server_structured.py runs the real model)."""

from __future__ import annotations

import contextlib
import json

import pytest
from starlette.testclient import TestClient

from outrider.core import RequestOutput, StructuredOutputs
from outrider.server.errors import APIError
from outrider.server.protocol import ChatCompletionRequest, CompletionRequest
from outrider.server.structured import NO_ARGUMENTS, request_constraint, tool_call_constraint
from tests.unit.test_server_async_engine import FakeCore
from tests.unit.test_server_errors_unit import AUTH, fake_app

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {  # properties out of alphabetical order: the order the client wrote must survive
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SCHEMA_TEXT = json.dumps(SCHEMA)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}


def constraint(body: dict, chat: bool = True):
    model = ChatCompletionRequest if chat else CompletionRequest
    req = model.model_validate({**({"messages": MSG} if chat else {"prompt": "hi"}), **body})
    return request_constraint(req)


def refusal(body: dict, chat: bool = True) -> APIError:
    with pytest.raises(APIError) as info:
        constraint(body, chat)
    assert info.value.status == 400
    return info.value


# -- request body -> StructuredOutputs -----------------------------------------------------------

MAPPED = [
    ({"response_format": {"type": "json_object"}}, "response_format", {"json_object": True}),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA},
            }
        },
        "response_format",
        {"json": SCHEMA_TEXT},
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA, "strict": True, "description": "d"},
            }
        },
        "response_format",
        {"json": SCHEMA_TEXT},
    ),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", {"json": SCHEMA_TEXT}),
    ({"structured_outputs": {"json": SCHEMA_TEXT}}, "structured_outputs", {"json": SCHEMA_TEXT}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs", {"regex": "[a-z]+"}),
    (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        "structured_outputs",
        {"choice": ["yes", "no"]},
    ),
    (
        {"structured_outputs": {"grammar": 'start: "a"+'}},
        "structured_outputs",
        {"grammar": 'start: "a"+'},
    ),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs", {"json_object": True}),
    (
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        "structured_outputs",
        {"json": SCHEMA_TEXT, "disable_any_whitespace": True},
    ),
    ({"guided_json": SCHEMA}, "guided_json", {"json": SCHEMA_TEXT}),
    ({"guided_json": SCHEMA_TEXT}, "guided_json", {"json": SCHEMA_TEXT}),
    ({"guided_regex": r"\d{3}"}, "guided_regex", {"regex": r"\d{3}"}),
    ({"guided_choice": ["red", "blue"]}, "guided_choice", {"choice": ["red", "blue"]}),
    ({"guided_grammar": 'root ::= "x"'}, "guided_grammar", {"grammar": 'root ::= "x"'}),
    ({"json_schema": SCHEMA_TEXT}, "json_schema", {"json": SCHEMA_TEXT}),
    ({"regex": "(yes|no)"}, "regex", {"regex": "(yes|no)"}),
    ({"ebnf": 'root ::= "a" | "b"'}, "ebnf", {"grammar": 'root ::= "a" | "b"'}),
]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(("body", "field", "want"), MAPPED)
def test_every_spelling_becomes_one_structured_output(body, field, want, chat):
    got = constraint(body, chat)
    assert got.field == field
    assert got.outputs == StructuredOutputs(**want)


def test_a_schema_keeps_the_clients_key_order():
    got = constraint(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    )
    assert list(json.loads(got.outputs.json)["properties"]) == ["name", "age"]


@pytest.mark.parametrize(
    "body",
    [{}, {"response_format": {"type": "text"}}, {"tools": [WEATHER_TOOL], "tool_choice": "auto"}],
)
def test_text_and_no_fields_constrain_nothing(body):
    assert constraint(body) is None


# -- conflicts and fields that cannot be read ------------------------------------------------------

JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a+"}, ["guided_json", "guided_regex"]),
        (
            {"response_format": JSON_FORMAT, "guided_regex": "a+"},
            ["response_format", "guided_regex"],
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            ["response_format", "structured_outputs"],
        ),
        ({"structured_outputs": {"regex": "a"}, "regex": "b"}, ["structured_outputs", "regex"]),
        ({"json_schema": SCHEMA_TEXT, "ebnf": 'root ::= "a"'}, ["json_schema", "ebnf"]),
        ({"guided_choice": ["a"], "json_schema": SCHEMA_TEXT}, ["guided_choice", "json_schema"]),
    ],
)
def test_two_constraints_are_400_naming_both(body, named):
    for chat in (True, False):
        err = refusal(body, chat)
        assert all(name in err.message for name in named), err.message
        assert err.param in named


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format.json_schema",
            ["no schema"],
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["schema"]),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            ["exactly one"],
        ),
        ({"structured_outputs": {}}, "structured_outputs", ["nothing"]),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", ["nothing"]),
        ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
        ({"json_schema": "[1, 2]"}, "json_schema", ["not a JSON schema"]),
        ({"structured_outputs": {"json": "nope"}}, "structured_outputs.json", ["not valid JSON"]),
        ({"guided_choice": []}, "guided_choice", ["nothing"]),
        ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern", ["not supported"]),
    ],
)
def test_unreadable_constraints_are_400_naming_the_field(body, param, words):
    err = refusal(body)
    assert err.param == param, err.message
    assert all(w in err.message for w in words), err.message


# -- forced tool calls ---------------------------------------------------------------------------


def tool_constraint(body: dict, parser: str | None = "hermes"):
    from outrider.server.parsers.registry import build_tool_parser

    req = ChatCompletionRequest.model_validate({"messages": MSG, **body})
    return tool_call_constraint(req, build_tool_parser(parser) if parser else None)


def test_a_named_function_is_one_call_of_it():
    got = tool_constraint(
        {
            "tools": [TIME_TOOL, WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    grammar = got.outputs.grammar
    assert got.field == "tool_choice" and grammar.startswith("start: call\n")
    assert '\\"name\\": \\"get_weather\\"' in grammar and "get_time" not in grammar
    assert json.dumps(WEATHER_TOOL["function"]["parameters"]) in grammar


def test_required_is_a_call_of_any_tool_several_unless_parallel_calls_are_off():
    got = tool_constraint({"tools": [TIME_TOOL, WEATHER_TOOL], "tool_choice": "required"})
    grammar = got.outputs.grammar
    assert "get_time" in grammar and "get_weather" in grammar and "call)*" in grammar
    assert json.dumps(NO_ARGUMENTS) in grammar  # a tool without parameters takes none
    single = tool_constraint(
        {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    )
    assert single.outputs.grammar.startswith("start: call\n")


@pytest.mark.parametrize(
    ("body", "parser", "param", "words"),
    [
        ({"tool_choice": "required"}, "hermes", "tool_choice", ["needs tools"]),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"function": {"name": "nope"}}},
            "hermes",
            "tool_choice.function.name",
            ["'nope'", "get_weather"],
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required"},
            None,
            "tool_choice",
            ["--tool-parser"],
        ),
    ],
)
def test_forced_calls_that_cannot_be_kept_are_400(body, parser, param, words):
    with pytest.raises(APIError) as info:
        tool_constraint(body, parser)
    assert info.value.param == param
    assert all(w in info.value.message for w in words), info.value.message


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_auto_and_none_force_nothing(choice):
    assert tool_constraint({"tools": [WEATHER_TOOL], "tool_choice": choice}) is None


def test_a_forced_call_and_a_response_format_are_400_naming_both():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": MSG,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        }
    )
    with pytest.raises(APIError) as info:
        request_constraint(
            req, tool_constraint({"tools": [WEATHER_TOOL], "tool_choice": "required"})
        )
    assert "response_format" in info.value.message and "tool_choice" in info.value.message


# -- through the app -------------------------------------------------------------------------------

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedCore(FakeCore):
    """Says `text` for every request, in two deltas, and keeps each request's params. Refuses
    the regex "[" as an engine that compiles constraints does: naming structured_outputs."""

    def __init__(self, text: str = "ok") -> None:
        super().__init__(tokens=2)
        self.text = text
        self.params: list = []

    def validate(self, ids, params) -> None:
        super().validate(ids, params)
        so = params.structured_outputs
        if so is not None and so.regex == "[":
            raise ValueError("invalid structured_outputs.regex='[': unclosed character class")

    def add_request(self, ids, params, request_id=None):
        self.params.append(params)
        super().add_request(ids, params, request_id)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outs = []
        half = len(self.text) // 2
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == 2
            part = self.text[half:] if done else self.text[:half]
            outs.append(
                RequestOutput(rid, None, [1], part, [7], done, "stop" if done else None, {})
            )
            if done:
                del self.live[rid]
        return outs


@pytest.fixture
def scripted():
    """start(text, **server config) -> (the core, a client of the real app over it)."""
    with contextlib.ExitStack() as stack:

        def start(text: str = "ok", **server):
            core = ScriptedCore(text)
            app = stack.enter_context(fake_app(core, **server))
            return core, TestClient(app, headers=AUTH)

        yield start


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "hi"})],
)
def test_the_engine_gets_the_constraint_for_every_choice(scripted, path, base):
    core, client = scripted()
    body = {**base, "guided_choice": ["yes", "no"], "n": 2, "max_tokens": 4}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert [p.structured_outputs for p in core.params] == [
        StructuredOutputs(choice=("yes", "no"))
    ] * 2
    r = client.post(path, json={**base, "max_tokens": 4})
    assert r.status_code == 200 and core.params[-1].structured_outputs is None


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "hi"})],
)
@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("guided_regex", "[", "[a]"),
        ("regex", "[", "[a]"),
        ("structured_outputs", {"regex": "["}, {"regex": "[a]"}),
    ],
)
def test_an_engine_refusal_names_the_requests_field_and_the_server_serves_on(
    scripted, path, base, field, bad, good
):
    _, client = scripted()
    r = client.post(path, json={**base, field: bad, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert "unclosed character class" in err["message"]
    assert client.post(path, json={**base, field: good, "max_tokens": 4}).status_code == 200
    assert client.post(path, json={**base, "max_tokens": 4}).status_code == 200


def test_an_engine_refusal_of_the_prompt_still_names_the_prompt(scripted):
    core, client = scripted()
    r = client.post("/v1/completions", json={"prompt": [], "guided_regex": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_unknown_response_format_and_structured_outputs_fields_are_refused(scripted):
    _, client = scripted()
    r = client.post(
        "/v1/chat/completions", json={"messages": MSG, "response_format": {"type": "xml"}}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format.type"
    assert "json_schema" in err["message"]
    r = client.post(
        "/v1/completions",
        json={"prompt": "hi", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "structured_outputs.whitespace_pattern"


def test_a_forced_call_comes_back_as_tool_calls(scripted):
    core, client = scripted(HERMES_CALL, tool_parser="hermes")
    body = {
        "messages": MSG,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert core.params[-1].structured_outputs.grammar.startswith("start: call\n")
    stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line[6:].startswith("{")]
    calls = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in events)


def test_required_without_a_tool_parser_is_400(scripted):
    _, client = scripted()
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MSG, "tools": [WEATHER_TOOL], "tool_choice": "required"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_constrained_output_is_all_content_under_a_reasoning_parser(scripted):
    """deepseek_r1's template opens <think> itself, so an output without </think> would be all
    reasoning; a constrained one holds no reasoning, only the answer."""
    _, client = scripted('{"a": 1}', reasoning_parser="deepseek_r1")
    r = client.post(
        "/v1/chat/completions", json={"messages": MSG, "response_format": {"type": "json_object"}}
    )
    message = r.json()["choices"][0]["message"]
    assert message["content"] == '{"a": 1}' and message["reasoning_content"] is None
    plain = client.post("/v1/chat/completions", json={"messages": MSG})
    assert plain.json()["choices"][0]["message"]["reasoning_content"] == '{"a": 1}'
