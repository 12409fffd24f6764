"""Bad input never gets a 5xx: hand-made bad requests and hypothesis-generated bodies against a
live server always get OpenAI's error JSON with a 4xx, and the openai client raises its own
exception types. The API key guards every endpoint but /health."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow


KEY = "sk-errors-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = EngineCore(
        EngineConfig().replace(model={"dtype": "float32", "device": "cpu", "max_model_len": 256})
    )
    config = ServerConfig(api_key=KEY, max_n=2, default_max_tokens=3, max_body_bytes=1 << 20)
    with ServerThread(config, core) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


# -- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/no/such/route"),
    ],
)
def test_no_key_is_401_everywhere_but_health(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, server.base + path, headers=headers, json={"prompt": "x"})
        err = _assert_error(r, 401, "API key")
        assert err["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/health").status_code == 200
    head = httpx.head(server.base + "/health")  # load balancers probe with HEAD
    assert head.status_code == 200 and head.content == b""


def test_wrong_key_raises_authentication_error(server):
    bad = openai.OpenAI(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- hand-made bad input -----------------------------------------------------------------------


def test_client_exception_types(client, server):
    model = server.state.model_name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-5", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=MSG, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens=100000 is more than"):
        client.completions.create(model=model, prompt="Hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model=model, prompt="")
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.completions.create(model=model, prompt="Hi", n=3)


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/chat/completions", b"{not json", 400, ["JSON"]),
        ("/v1/chat/completions", b'{"messages": "\xff\xfe\xfa"}', 400, ["UTF-8"]),
        ("/v1/chat/completions", b"[1, 2]", 400, ["object"]),
        ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": -5}, 400, ["max_tokens"]),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, ["max_tokens"]),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**30}, 400, ["max_tokens"]),
        ("/v1/chat/completions", {"messages": MSG, "model": "x"}, 404, ["'x'"]),
        ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 50}, 400, ["top_logprobs"]),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"1": 5}}, 400, ["logit_bias"]),
        ("/v1/chat/completions", {"messages": MSG, "tool_choice": "required"}, 400, ["tool"]),
        ("/v1/chat/completions", {"messages": [{"role": "wizard"}]}, 400, ["role"]),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            ["text parts"],
        ),
        ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [10**9]}, 400, ["vocab"]),
        ("/v1/completions", {"prompt": ""}, 400, ["empty"]),
        ("/v1/completions", {"prompt": []}, 400, ["empty"]),
        ("/v1/completions", {"prompt": [5, -1]}, 400, ["vocabulary"]),
        ("/v1/completions", {"prompt": [10**20]}, 400, ["vocabulary"]),
        ("/v1/completions", {"prompt": "Hi", "stop": [""]}, 400, ["stop"]),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, ["temperature"]),
        ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, 400, ["suffix"]),
        ("/v1/completions", {"prompt": "Hi " * 400}, 400, ["context"]),
        # too long to fit whatever its tokens: refused from its length, never tokenized
        ("/v1/completions", {"prompt": "x" * 30_000}, 400, ["30000 characters", "context"]),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 30_000}]},
            400,
            ["characters", "context"],
        ),
        ("/v1/completions", b'{"prompt": "\\ud800"}', 400, ["tokenized"]),
        ("/v1/completions", {}, 400, ["prompt"]),
    ],
)
def test_bad_requests_get_400_json(http, path, body, status, words):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    _assert_error(r, status, *words)


def test_nan_and_infinity_are_400(http):
    body = b'{"prompt": "Hi", "temperature": NaN, "max_tokens": 2}'
    _assert_error(http.post("/v1/completions", content=body), 400, "temperature")
    body = b'{"prompt": "Hi", "repetition_penalty": Infinity}'
    _assert_error(http.post("/v1/completions", content=body), 400, "repetition_penalty")


def test_ten_megabyte_body_is_413(http):
    big = json.dumps({"prompt": "x" * (10 << 20)}).encode()
    _assert_error(http.post("/v1/completions", content=big), 413, "bytes")

    def chunks():  # no Content-Length: the cap must hold on the streamed body too
        for _ in range(20):
            yield b"x" * (1 << 19)

    _assert_error(http.post("/v1/completions", content=chunks()), 413, "bytes")


def test_wrong_method_and_route_are_json(http):
    _assert_error(http.get("/v1/chat/completions"), 405)
    _assert_error(http.get("/v1/nothing"), 404, "no route")


def test_cors_is_off_unless_configured(server):
    r = httpx.get(server.url + "/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(
        server.url + "/models",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in pre.headers


def test_server_still_answers_after_bad_input(client, server):
    r = client.completions.create(model=server.state.model_name, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2


# -- hypothesis: bodies against the schema -------------------------------------------------------

_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_ints = st.integers(min_value=-3, max_value=6) | st.sampled_from(
    [0, 2**31, 2**63, -(2**63), 10**40]
)
_floats = st.floats(min_value=-3, max_value=3) | st.sampled_from([0.0, 1e-30, 1e30, -0.0])
_text = st.text(max_size=12)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot"])},
    optional={"content": _text | st.none() | _any_json, "name": _text},
)
_common = {
    "model": st.sampled_from([None, "wrong-model"]) | _text,
    "max_tokens": _ints | st.none() | _any_json,
    "temperature": _floats | st.none() | _text,
    "top_p": _floats,
    "top_k": _ints,
    "min_p": _floats,
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "repetition_penalty": _floats,
    "seed": _ints | st.none(),
    "n": _ints,
    "stop": _text | st.lists(_text, max_size=2) | st.none(),
    "stop_token_ids": st.lists(_ints, max_size=2),
    "min_tokens": _ints,
    "stream": st.booleans(),
    "logit_bias": st.none() | st.dictionaries(_text, _floats, max_size=1),
    # Structured outputs: whatever the engine makes of a schema, regex or grammar, never a 5xx.
    "response_format": _any_json
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": _any_json})},
    ),
    "structured_outputs": _any_json
    | st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]), _text, max_size=2),
    "guided_json": _any_json | _text,
    "guided_regex": _text | _any_json,
    "guided_choice": st.lists(_text, max_size=2) | _any_json,
    "guided_grammar": _text,
    "ebnf": _text,
}
CHAT_BODIES = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3) | _any_json},
    optional={
        **_common,
        "logprobs": st.booleans() | _any_json,
        "top_logprobs": _ints,
        "max_completion_tokens": _ints,
        "tools": st.none() | _any_json,
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | _any_json,
    },
)
# Bodies the schema accepts, so generation itself is exercised too, not only refusals.
_valid = {
    "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**40),
    "n": st.integers(1, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stream": st.booleans(),
}
VALID_CHAT = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": _text}),
            min_size=1,
            max_size=2,
        )
    },
    optional={**_valid, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)},
)
VALID_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=12)
        | st.lists(st.integers(0, 49151), min_size=1, max_size=4)
    },
    optional={**_valid, "logprobs": st.integers(0, 3), "echo": st.booleans()},
)
COMPLETION_BODIES = st.fixed_dictionaries(
    {"prompt": _text | st.lists(_ints, max_size=4) | st.lists(_text, max_size=2) | _any_json},
    optional={**_common, "logprobs": _ints | st.none(), "echo": st.booleans()},
)


def _check_never_5xx(http, path: str, body) -> None:
    if body.get("max_tokens") is None or body.get("max_tokens") is True:
        body["max_tokens"] = 2  # keep generation short: the point is the parsing
    # json.dumps writes NaN / Infinity as JS literals: the server must refuse them, not crash.
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code == 200:
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
        else:
            assert r.json()["choices"], r.text
    else:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=VALID_CHAT | CHAT_BODIES)
def test_fuzz_chat_bodies(http, body):
    _check_never_5xx(http, "/v1/chat/completions", body)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=VALID_COMPLETION | COMPLETION_BODIES)
def test_fuzz_completion_bodies(http, body):
    _check_never_5xx(http, "/v1/completions", body)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=64) | _any_json.map(lambda v: json.dumps(v).encode()))
def test_fuzz_raw_bytes(http, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, (raw, r.text)
        if r.status_code != 200:
            assert "error" in r.json()
