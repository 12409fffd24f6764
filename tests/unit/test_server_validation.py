"""Request validation says what it refused: JSON types are taken strictly (true is not 1.0, "yes"
is not true), a refusal quotes the value it refused (clipped), a number too long for Python is
a 400 at its field, chat_template_kwargs cannot reach the renderer's own arguments, and HEAD
/health answers like GET. The app is the real one over a scripted engine."""

from __future__ import annotations

import inspect
import json

import pytest
from starlette.testclient import TestClient

from outrider.server.protocol import RENDERER_ARGUMENTS
from tests.unit.test_server_errors_unit import AUTH, FakeCore, fake_app

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def app():
    with fake_app(FakeCore(tokens=1)) as a:
        yield a


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, headers=AUTH)


def body_for(path: str, **fields) -> dict:
    return {"messages": MSG, **fields} if path == CHAT else {"prompt": "hi", **fields}


def error(r, param: str, *words: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err["message"]


# -- booleans are not numbers, strings are not booleans --------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
     "repetition_penalty"],
)  # fmt: skip
def test_true_is_not_a_number(client, path, field):
    r = client.post(path, json=body_for(path, **{field: True}))
    error(r, field, "not a boolean", "(got true)")


@pytest.mark.parametrize(
    ("path", "field"),
    [(CHAT, "stream"), (COMPLETIONS, "stream"), (CHAT, "logprobs"), (COMPLETIONS, "echo"),
     (CHAT, "add_generation_prompt"), (COMPLETIONS, "ignore_eos"),
     (COMPLETIONS, "skip_special_tokens"), (CHAT, "include_stop_str_in_output"),
     (CHAT, "parallel_tool_calls")],
)  # fmt: skip
@pytest.mark.parametrize(("value", "shown"), [("yes", '"yes"'), ("false", '"false"'), (1, "1")])
def test_only_true_and_false_are_booleans(client, path, field, value, shown):
    r = client.post(path, json=body_for(path, **{field: value}))
    error(r, field, "valid boolean", f"(got {shown})")


def test_stream_options_and_structured_switches_are_strict_too(client):
    r = client.post(CHAT, json=body_for(CHAT, stream=True, stream_options={"include_usage": 1}))
    error(r, "stream_options.include_usage", "valid boolean")
    r = client.post(CHAT, json=body_for(CHAT, structured_outputs={"json_object": "on"}))
    error(r, "structured_outputs.json_object", "valid boolean", '(got "on")')


def test_numbers_and_booleans_of_the_right_type_still_pass(client):
    for path in (CHAT, COMPLETIONS):
        body = body_for(path, temperature=0.5, top_p="0.9", stream=False, max_tokens=1)
        assert client.post(path, json=body).status_code == 200
    r = client.post(CHAT, json=body_for(CHAT, temperature=0, stream=True, max_tokens=1))
    assert r.status_code == 200 and "data: [DONE]" in r.text


# -- a refusal quotes the value, clipped --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param", "shown"),
    [
        (COMPLETIONS, {"temperature": "hot"}, "temperature", '(got "hot")'),
        (COMPLETIONS, {"max_tokens": 10**30}, "max_tokens", f"(got {10**30})"),
        (COMPLETIONS, {"n": -1}, "n", "(got -1)"),
        (CHAT, {"messages": [{"role": "wizard"}]}, "messages.0.role", '(got "wizard")'),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "(got 5)"),
        (CHAT, {"tool_choice": "maybe"}, "tool_choice", '(got "maybe")'),
    ],
)
def test_a_refusal_names_field_and_value(client, path, fields, param, shown):
    error(client.post(path, json=body_for(path, **fields)), param, f"invalid {param}", shown)


def test_a_long_value_is_quoted_clipped_and_a_missing_one_not_at_all(client):
    r = client.post(CHAT, json=body_for(CHAT, response_format={"type": "y" * 100_000}))
    message = error(r, "response_format.type", '(got "yyy', "… (100000 characters)")
    assert len(message) < 500
    r = client.post(CHAT, json=body_for(CHAT, stop={"a": "x" * 100_000}))
    assert len(error(r, "stop", "characters of JSON")) < 500
    message = error(client.post(COMPLETIONS, json={}), "prompt", "Field required")
    assert "got" not in message  # nothing was sent: pydantic's input is the whole body


# -- numbers Python would not read ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -'
         + b"1" * 5000 + b"}", "temperature"),
        (COMPLETIONS, b'{"prompt": [1, 2, ' + b"3" * 4301 + b"]}", "prompt.2"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
         b'{"x": ' + b"7" * 5000 + b"}}", "chat_template_kwargs.x"),
    ],
)  # fmt: skip
def test_a_5000_digit_number_is_a_400_at_its_field(client, path, raw, param):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    message = error(r, param, "digits", "in the field's range")
    assert "sys." not in message and "int_max_str_digits" not in message


def test_a_long_number_in_broken_json_reports_the_json_error_only(client):
    raw = b'{"prompt": ' + b"9" * 5000 + b", "
    r = client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "not valid UTF-8 JSON" in message and "sys." not in message


def test_numbers_python_reads_still_reach_the_field_check(client):
    raw = b'{"prompt": "hi", "max_tokens": ' + b"9" * 4000 + b"}"
    r = client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    error(r, "max_tokens", "less than or equal to")


# -- chat_template_kwargs cannot reach the renderer's arguments ---------------------------------


@pytest.mark.parametrize("name", sorted(RENDERER_ARGUMENTS))
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_reserved_template_variables_are_refused_by_name(client, path, name):
    body = {"messages": MSG, "chat_template_kwargs": {name: 1, "enable_thinking": False}}
    message = error(client.post(path, json=body), "chat_template_kwargs", repr(name))
    assert "multiple values" not in message and "Tokenizer" not in message


def test_other_template_variables_still_reach_the_template(client):
    body = {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}}
    assert client.post("/tokenize", json=body).status_code == 200


def test_reserved_names_are_the_renderers_arguments():
    from outrider.loaders.tokenizer import Tokenizer

    names = set()
    for method in (Tokenizer.encode_chat, Tokenizer.apply_chat_template):
        params = inspect.signature(method).parameters.values()
        names |= {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert names == RENDERER_ARGUMENTS


# -- HEAD /health --------------------------------------------------------------------------------


def test_head_health_answers_like_get_without_a_key(app):
    bare = TestClient(app)
    get, head = bare.get("/health"), bare.head("/health")
    assert get.status_code == head.status_code == 200
    assert json.loads(get.content)["status"] == "ok" and head.content == b""
    assert bare.head("/v1/models").status_code == 401  # the key still guards the rest
