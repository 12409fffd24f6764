"""Error paths of the app without a model: a scripted engine (test_server_async_engine's
FakeCore) and a real word-level tokenizer behind the real app, driven in process. Every refusal
is OpenAI's error JSON, names the field at fault and quotes no request value whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from tests.unit.test_server_async_engine import FakeCore

KEY = "sk-unit-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
RAW_AUTH = (b"authorization", AUTH["Authorization"].encode())
MSG = [{"role": "user", "content": "hi"}]


def _tokenizer():
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from outrider.loaders.tokenizer import Tokenizer

    words = ["<unk>", "<s>", "</s>", "hi", "there", "user", "assistant", ":"]
    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    return Tokenizer(backend, chat_template=template, bos_token_id=1, eos_token_ids=[2])


@contextlib.contextmanager
def fake_app(core: FakeCore, **server: object) -> Iterator:
    """The real app over `core` (given the word-level tokenizer), its engine thread running."""
    from outrider.server.app import build_app
    from outrider.server.async_engine import AsyncEngine
    from outrider.server.config import ServerConfig
    from outrider.server.state import ServerState

    core.tokenizer = _tokenizer()
    engine = AsyncEngine(core)
    config = ServerConfig(api_key=KEY, served_model_name="fake", **server)
    state = ServerState.build(engine, config, "fake")
    engine.start()
    try:
        yield build_app(state, KEY)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def app():
    with fake_app(FakeCore(tokens=2), max_body_bytes=1 << 20) as a:
        yield a


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, headers=AUTH)


def _error(r, status: int, *words: str, param: object = ...) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    if param is not ...:
        assert err["param"] == param, err
    return err


def _asgi(app, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes):
    """One request straight into the ASGI app, headers exactly as given (an HTTP client would
    compute Content-Length itself): (status, headers, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("t", 80),
    }  # fmt: skip
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


# 1. -- the Bearer scheme is case-insensitive --------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_in_any_case(app, scheme):
    r = TestClient(app).get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "value", ["", KEY, f"Basic {KEY}", "bearer wrong", f"bearer{KEY}", f"Bearer {KEY}x"]
)
def test_anything_but_bearer_and_the_key_is_401(app, value):
    r = TestClient(app).get("/v1/models", headers={"Authorization": value} if value else {})
    assert _error(r, 401, "API key", param=None)["code"] == "invalid_api_key"


# 2. -- a bad Content-Length is 400 JSON ----------------------------------------------------------


@pytest.mark.parametrize("value", [b"-1", b"abc", b"1_6", b"+16", b"16, 16", b"0x10"])
def test_bad_content_length_is_400_json(app, value):
    headers = [RAW_AUTH, (b"content-length", value)]
    body = b'{"prompt": "hi"}'  # 16 bytes
    status, out_headers, out = _asgi(app, "POST", "/v1/completions", headers, body)
    assert status == 400, (status, out)
    assert out_headers[b"content-type"] == b"application/json"
    err = json.loads(out)["error"]
    assert "Content-Length" in err["message"] and err["type"] == "invalid_request_error"


def test_two_different_content_lengths_are_400(app):
    headers = [RAW_AUTH, (b"content-length", b"16"), (b"content-length", b"3")]
    status, _, out = _asgi(app, "POST", "/v1/completions", headers, b'{"prompt": "hi"}')
    assert status == 400 and b"Content-Length" in out


def test_unparsable_http_gets_json_from_the_protocol(app):
    # uvicorn's h11 refuses these before the app runs: only the protocol class can answer JSON.
    import functools
    import socket
    import threading
    import time

    import uvicorn

    from outrider.server.guards import GuardedH11Protocol

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    protocol = functools.partial(GuardedH11Protocol, header_timeout=10, max_connections=100)
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="critical")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        for value in (b"-1", b"abc", b"1_6"):
            with socket.create_connection(sock.getsockname(), timeout=10) as c:
                c.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %s\r\n\r\n{}"
                    % value
                )
                data = b""
                while chunk := c.recv(65536):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_a_huge_content_length_is_413_json(app):
    headers = [RAW_AUTH, (b"content-length", b"9" * 5000)]
    status, _, out = _asgi(app, "POST", "/v1/completions", headers, b"{}")
    assert status == 413 and "5000-digit" in json.loads(out)["error"]["message"]


# 3. -- a lone surrogate is not valid Unicode ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["hi", "there \\uDFFF"]}', "prompt.1"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udbff!"]}', "stop.0"),
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # the raw bytes
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a \\ud83d b"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(client, path, body, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    err = _error(r, 400, "not valid Unicode", "UTF-8", param=param)
    assert "TextInputSequence" not in err["message"]


def test_paired_surrogates_are_fine(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text


# 4. -- booleans are not token ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[1, 2], [True]]}, "prompt"),
        ({"prompt": [1.0, 2.0]}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ],
)
def test_booleans_and_floats_are_not_token_ids(client, body, param):
    r = client.post("/v1/completions", json=body)
    _error(r, 400, param.split(".")[0], param=param)


def test_prompt_booleans_say_so(client):
    err = _error(client.post("/v1/completions", json={"prompt": [True]}), 400, param="prompt")
    assert "true/false are not token ids" in err["message"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/completions", "n"),
        ("/v1/completions", "seed"),
        ("/v1/completions", "logprobs"),
        ("/v1/chat/completions", "top_logprobs"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_booleans_are_not_counts_either(client, path, field):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    err = _error(client.post(path, json={**body, field: True}), 400, param=field)
    assert "boolean" in err["message"]
    needs = {"logprobs": True} if field == "top_logprobs" else {}
    r = client.post(path, json={**body, **needs, field: 1})
    assert r.status_code == 200, r.text  # the integer itself is fine


def test_token_id_prompts_still_work(client):
    for prompt in ([3, 4], [[3], [4, 3]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text


# 5. -- echoed input is cut ---------------------------------------------------------------------


def test_long_model_name_is_not_echoed_whole(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "m" * 1_000_000})
    err = _error(r, 404, "does not exist", param="model")
    assert len(r.content) < 2_000 and len(err["message"]) <= 1_000


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "stop": ["", "x" * 100_000]}, "stop.1"),  # too long
        ("/v1/completions", {"prompt": "hi", "stop": ["", *["x" * 256] * 63]}, "stop"),  # empty
        (
            "/v1/chat/completions",
            {"messages": MSG, "response_format": {"type": "y" * 10**5}},
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "z" * 10**5}]}]},
            "messages.0.content",
        ),
    ],
)
def test_no_error_quotes_a_value_whole(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400 and len(r.content) < 2_000, (r.status_code, len(r.content))
    assert r.json()["error"]["param"] == param


def test_long_route_and_content_type_are_cut(client):
    _error(client.get("/v1/" + "p" * 50_000), 404, "no route", "characters")
    r = client.post(
        "/v1/completions", content=b"{}", headers={"content-type": "text/" + "q" * 10**4}
    )
    assert len(r.content) < 2_000 and r.status_code == 415


# 6. -- only JSON content types -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_non_json_content_type_is_415(client, path, content_type):
    body = json.dumps({"prompt": "hi", "messages": MSG}).encode()
    r = client.post(path, content=body, headers={"content-type": content_type})
    _error(r, 415, "Content-Type", "application/json", param=None)


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "application/json; charset=utf-8", "Application/JSON",
     "application/vnd.api+json"],
)  # fmt: skip
def test_json_or_missing_content_type_is_accepted(app, content_type):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    r = TestClient(app).post(
        "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers
    )
    assert r.status_code == 200, r.text


# 7. -- param names the field at fault ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "wizard"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages.0.content.0.type",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSG, "tool_choice": {"type": "function"}},
            "tool_choice.function",
        ),
    ],
)
def test_param_names_the_field(client, path, body, param):
    err = _error(client.post(path, json=body), 400)
    assert err["param"] == param, err
    assert "list[" not in err["message"] and ".str" not in err["message"], err


def test_a_client_gone_before_its_body_arrived_is_a_quiet_499():
    """The soak run's case: Content-Length promises more than arrives, then the client closes.
    That was an unhandled ClientDisconnect (two tracebacks and a 500 nobody received)."""
    import asyncio

    from fastapi import Request

    from outrider.server.errors import APIError
    from outrider.server.protocol import CompletionRequest
    from outrider.server.serving import read_body

    messages = [
        {"type": "http.request", "body": b'{"prompt": "hi"', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(Request(scope, receive), CompletionRequest))
    assert e.value.status == 499


def test_a_body_that_never_finishes_arriving_times_out_with_408(monkeypatch):
    """A client that promises a body and sends it never (the soak's chunked case hung 30 s)
    holds the connection only until the body timeout."""
    import asyncio

    from fastapi import Request

    from outrider.server import serving
    from outrider.server.errors import APIError
    from outrider.server.protocol import CompletionRequest

    monkeypatch.setattr(serving, "BODY_TIMEOUT_S", 0.2)
    first = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}]

    async def receive():
        if first:
            return first.pop(0)
        await asyncio.sleep(3600)  # the rest never comes

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    with pytest.raises(APIError) as e:
        asyncio.run(serving.read_body(Request(scope, receive), CompletionRequest))
    assert e.value.status == 408 and "did not arrive" in e.value.message


# -- routes outrider does not serve -------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/v1/images/generations"),
        ("POST", "/v1/moderations"),
    ],
)
def test_unserved_openai_endpoint_says_so_and_lists_routes(client, method, path):
    err = _error(client.request(method, path, json={}), 404, "does not serve", path)
    for served in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert served in err["message"], err["message"]
    assert "see GET /v1/models" not in err["message"]


def test_unknown_route_names_path_and_lists_routes(client):
    err = _error(client.get("/v2/whatever"), 404, "no route GET '/v2/whatever'", "/health")
    assert "does not serve" not in err["message"] and "/v1/chat/completions" in err["message"]
