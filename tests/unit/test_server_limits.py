"""What one request may ask for (server/limits.py): past a limit the server answers 400 naming
the field, the value, the limit and the flag that raises it, before any template or tokenizer
runs; at the limit the request runs. The app is the real one over a scripted engine."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from outrider.cli import build_parser
from outrider.server.cli import configs_from_args
from tests.unit.test_server_errors_unit import AUTH, FakeCore, fake_app

LIMITS = dict(
    max_n=2, max_stop_strings=4, max_stop_string_chars=8, max_stop_token_ids=3, max_tools=2,
    max_tools_chars=300, max_logprobs=5, max_prompt_chars=50,
)  # fmt: skip
MSG = [{"role": "user", "content": "hi"}]


def tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description}}


@pytest.fixture(scope="module")
def client():
    with fake_app(FakeCore(tokens=1), **LIMITS) as app:
        yield TestClient(app, headers=AUTH)


@pytest.fixture
def no_tokenizing(monkeypatch):
    """Any template render or tokenization fails the test (a refusal must come first)."""
    from outrider.loaders.tokenizer import Tokenizer

    def never(*args, **kwargs):
        raise AssertionError("tokenized a request that is over a limit")

    for name in ("encode", "encode_chat", "apply_chat_template"):
        monkeypatch.setattr(Tokenizer, name, never)


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 3}, "n", ["n=3", "(2)", "--max-n"]),
        (
            "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop",
            ["5 stop strings", "(4)", "--max-stop-strings", "max_stop_strings"],
        ),
        (
            "/v1/completions", {"prompt": "hi", "stop": "123456789"}, "stop",
            ["'123456789'", "9 characters", "(8 characters)", "--max-stop-string-chars"],
        ),
        (
            "/v1/chat/completions", {"messages": MSG, "stop": ["ok", "y" * 1000]}, "stop.1",
            ["1000 characters", "(8 characters)", "--max-stop-string-chars"],
        ),
        (
            "/v1/chat/completions", {"messages": MSG, "stop_token_ids": [1, 2, 3, 4]},
            "stop_token_ids", ["4 stop_token_ids", "(3)", "--max-stop-token-ids"],
        ),
        (
            "/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs",
            ["logprobs=6", "(5)", "--max-logprobs"],
        ),
        (
            "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 6},
            "top_logprobs", ["top_logprobs=6", "(5)", "--max-logprobs"],
        ),
        (
            "/v1/chat/completions", {"messages": MSG, "tools": [tool("a"), tool("b"), tool("c")]},
            "tools", ["3 tools", "(2)", "--max-tools"],
        ),
        (
            "/v1/chat/completions", {"messages": MSG, "tools": [tool("a", "d" * 400)]}, "tools",
            ["tools' JSON has", "(300 characters)", "--max-tools-chars"],
        ),
        (
            "/v1/completions", {"prompt": "a" * 51}, "prompt",
            ["51 characters", "(50 characters)", "--max-prompt-chars", "token ids"],
        ),
        (
            "/v1/completions", {"prompt": ["a" * 30, "b" * 30]}, "prompt",
            ["2 prompts have 60 characters", "--max-prompt-chars"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 30}, {"role": "assistant",
              "content": [{"type": "text", "text": "b" * 30}]}]},
            "messages", ["60 characters", "(50 characters)", "--max-prompt-chars"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function":
              {"name": "f", "arguments": {"x": "y" * 60}}}]}]},
            "messages", ["--max-prompt-chars"],
        ),
        ("/tokenize", {"prompt": "a" * 51}, "prompt", ["51 characters", "--max-prompt-chars"]),
        (
            "/tokenize", {"messages": [{"role": "user", "content": "a" * 51}]}, "messages",
            ["51 characters", "--max-prompt-chars"],
        ),
    ],
)  # fmt: skip
def test_over_a_limit_is_400_naming_value_limit_and_flag(
    client, no_tokenizing, path, body, param, words
):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert len(r.content) < 2_000  # the value is quoted clipped


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {"prompt": "a" * 50, "n": 2, "stop": ["12345678", "b", "c", "d"],
             "stop_token_ids": [1, 2, 3], "logprobs": 5, "max_tokens": 1},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 48}], "logprobs": True,
             "top_logprobs": 5, "tools": [tool("a"), tool("b")], "stop": "12345678"},
        ),
        ("/v1/completions", {"prompt": [1] * 60, "max_tokens": 1}),  # ids: the engine's bound
        ("/tokenize", {"prompt": "a" * 50}),
    ],
)  # fmt: skip
def test_at_every_limit_the_request_runs(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_the_engine_limit_on_top_logprobs_names_no_flag():
    with fake_app(FakeCore(tokens=1)) as app:
        r = TestClient(app, headers=AUTH).post(
            "/v1/completions", json={"prompt": "hi", "logprobs": 21}
        )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logprobs"
    assert "logprobs=21" in err["message"] and "20" in err["message"]
    assert "--max-logprobs" not in err["message"]  # at 20 already: no flag raises it


def test_limits_are_serve_flags():
    args = build_parser().parse_args(
        ["serve", "--max-stop-strings", "8", "--max-stop-string-chars", "32",
         "--max-stop-token-ids", "9", "--max-tools", "3", "--max-tools-chars", "1000",
         "--max-logprobs", "4", "--max-prompt-chars", "100"]
    )  # fmt: skip
    server, _ = configs_from_args(args)
    assert (server.max_stop_strings, server.max_stop_string_chars, server.max_stop_token_ids,
            server.max_tools, server.max_tools_chars, server.max_logprobs,
            server.max_prompt_chars) == (8, 32, 9, 3, 1000, 4, 100)  # fmt: skip
