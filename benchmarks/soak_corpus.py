"""The pure parts of benchmarks/soak.py: the fuzz corpus (each case with the statuses a correct
server may answer), response parsing, tallies and the must-hold verdict. No server, no I/O."""

from __future__ import annotations

import ast
import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

HOST = "127.0.0.1"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ANY = frozenset()  # any answer but a 5xx or a hang

# -- the corpus (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One hostile request. `expect` holds the outcomes a correct server gives (a status code
    as text, "closed" or "reset"); empty means any but a 5xx or a hang. `param`: the field an
    error answer must name (OpenAI's error.param), when it matters."""

    name: str  # "<category>:<detail>"
    raw: bytes  # the whole HTTP/1.1 request, `Connection: close`
    expect: frozenset[str] = ANY
    half_close: bool = False  # send EOF after the request: a body shorter than Content-Length
    framing: bool = False  # broken HTTP framing: uvicorn answers, not the app (no JSON error)
    param: str | None = None


def http_request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: Sequence[tuple[str, str | bytes]] = (),
    content_length: bool | str = True,
    host: bool = True,
) -> bytes:
    """Raw request bytes. content_length: True counts the body, False leaves the header out, a
    string is sent as given."""
    lines = [f"{method} {path} HTTP/1.1".encode()]
    lines += [b"Host: 127.0.0.1"] if host else []
    lines.append(b"Connection: close")
    for k, v in headers:
        lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode("latin-1")))
    if content_length is True:
        lines.append(b"Content-Length: %d" % len(body))
    elif content_length:
        lines.append(b"Content-Length: " + content_length.encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _expect(text: str) -> frozenset[str]:
    return ANY if text == "any" else frozenset(text.split("|"))


def _expect_param(text: str) -> tuple[frozenset[str], str | None]:
    """(statuses, param): 400@max_tokens -> ({"400"}, "max_tokens"); 400|404 -> (both, None)."""
    statuses, _, param = text.partition("@")
    return _expect(statuses), param or None


# Body mutations, one a line: the endpoint (c: completions, h: chat), the answers a correct
# server gives ("any": all but 5xx and hangs; lax coercions pydantic accepts are "any"; "@field":
# the error's param), then JSON
# merged into the base body ({"prompt": "Hello"} or one user message, max_tokens 2, greedy).
# JSON escapes stay escapes on the wire: "\ud800" is a lone surrogate. $MODEL: the served name;
# $CONTEXT: the served max_model_len (the small cache lowers it below the model's 8192).
_MUTATIONS = r"""
[valid]
c 200 {}
h 200 {}
c 200 {"stream": true}
h 200 {"stream": true, "stream_options": {"include_usage": true}}
c 200 {"model": "$MODEL"}
c 200 {"prompt": [1, 2, 3]}
c 200 {"prompt": ["a", "b"]}
c 200 {"n": 8}
c 200 {"max_tokens": null}
c 200 {"prompt": " "}
c 200 {"prompt": [0, 1, 49151]}
[wrong_type]
c 400 {"prompt": {"a": 1}}
c 400 {"prompt": 5}
c 400 {"prompt": null}
c 400 {"prompt": [["a"]]}
c 400 {"prompt": [1, "a"]}
h 400 {"messages": "Hi"}
h 400 {"messages": {"role": "user"}}
h 400 {"messages": [{}]}
h 400 {"messages": [["user", "Hi"]]}
h 400 {"messages": [{"role": "user", "content": 5}]}
h 400 {"messages": [{"role": "wizard", "content": "Hi"}]}
h 400 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
h any {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
c any {"max_tokens": "2"}
c any {"max_tokens": true}
c 400 {"max_tokens": 2.5}
c 400 {"max_tokens": [2]}
c 400 {"temperature": "hot"}
c 400 {"temperature": []}
c 400 {"top_p": {}}
c 400 {"n": "two"}
c 400 {"n": 1.5}
c 400@stream {"stream": "yes"}
c 400 {"stream": 1}
c 400@temperature {"temperature": true}
h 400@top_p {"top_p": false}
c 400 {"stream": {}}
c 400 {"stop": 5}
c 400 {"stop": [1, 2]}
c 400 {"stop": [[]]}
c 400 {"stop": [""]}
c 400 {"seed": "x"}
c 400 {"seed": 1.5}
c 400 {"logprobs": "x"}
c 400 {"echo": "x"}
c any {"echo": true}
c 400 {"echo": true, "logprobs": 2}
c 400 {"stop_token_ids": "x"}
c 400 {"stop_token_ids": [-1]}
c 400 {"ignore_eos": "x"}
c 400 {"model": 5}
c 400 {"model": []}
c 400 {"stream_options": "x"}
c 400 {"logit_bias": []}
c 400 {"logit_bias": {"1": 5}}
c 400 {"user": 5}
c 400 {"min_tokens": "x"}
c 400 {"top_k": 1.5}
c 400 {"best_of": 2}
c 400 {"suffix": "x"}
h 400 {"tools": "x"}
h 400 {"tools": [{}]}
h 400 {"tool_choice": 5}
h 400 {"tool_choice": "required"}
h 400 {"response_format": "json"}
h 400 {"logprobs": "x"}
h 400 {"chat_template_kwargs": "x"}
[structured]
h 200 {"response_format": {"type": "json_object"}}
c 200 {"response_format": {"type": "json_object"}}
h 200 {"response_format": {"type": "text"}}
h 200 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
h 400@response_format {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}
h 400@response_format.json_schema.schema {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}
h 400@response_format.json_schema {"response_format": {"type": "json_schema"}}
h 400@response_format.type {"response_format": {"type": "xml"}}
c 400@guided_regex {"guided_regex": "["}
c 400 {"guided_regex": "a", "guided_choice": ["a"]}
[template]
h 400@chat_template_kwargs {"chat_template_kwargs": {"self": 1}}
h 400@chat_template_kwargs {"chat_template_kwargs": {"messages": []}}
h 400@chat_template_kwargs {"chat_template_kwargs": {"tools": [{}]}}
h 400@chat_template_kwargs {"chat_template_kwargs": {"add_generation_prompt": false}}
h 400@chat_template_kwargs {"chat_template_kwargs": {"add_special_tokens": true}}
h 400@chat_template_kwargs {"chat_template_kwargs": {"max_tokens": 1}}
h 200 {"chat_template_kwargs": {"enable_thinking": false, "x": [1]}}
[huge]
c 400 {"max_tokens": 1000000}
c 400 {"max_tokens": 4611686018427387904}
c 400 {"max_tokens": 9223372036854775808}
c 400 {"max_tokens": 18446744073709551616}
c 400 {"max_tokens": 1000000000000000000000000000000}
c 400 {"max_tokens": 1e308}
c 400 {"max_tokens": -1}
c 400 {"max_tokens": 0}
c 400 {"max_tokens": -9223372036854775808}
c 400 {"max_tokens": $CONTEXT}
c 400 {"max_tokens": 8192}
h 400 {"max_tokens": 9223372036854775808}
h 400 {"max_completion_tokens": 1000000000}
h 400 {"max_completion_tokens": -5}
c 400 {"temperature": 1e308}
c 400 {"temperature": 101}
c 400 {"temperature": -1e-9}
c 400 {"top_p": 0}
c 400 {"top_p": 1.0000001}
c 400 {"top_k": -2}
c 400 {"top_k": 2147483648}
c 400 {"top_k": 1099511627776}
c 400 {"n": 0}
c 400 {"n": 9}
c 400 {"n": 1000000000}
c 400 {"n": 1180591620717411303424}
c 400 {"seed": 9223372036854775808}
c 400 {"seed": -9223372036854775809}
c 400 {"seed": 1606938044258990275541962092341162602522202993782792835301376}
c 400 {"presence_penalty": 2.5}
c 400 {"presence_penalty": -1e9}
c 400 {"frequency_penalty": 1e300}
c 400 {"repetition_penalty": 0}
c 400 {"repetition_penalty": 0.001}
c 400 {"repetition_penalty": 1e9}
c 400 {"min_p": -0.1}
c 400 {"min_p": 1.5}
c 400@logprobs {"logprobs": 21}
c 400 {"logprobs": 1000000}
c 400 {"logprobs": -1}
h 400 {"logprobs": true, "top_logprobs": 21}
h 400 {"top_logprobs": -1}
c 400 {"min_tokens": -1}
c 400 {"min_tokens": 1099511627776}
c 400 {"min_tokens": 100}
c 400 {"stop_token_ids": [1000000000]}
c 400 {"stop_token_ids": [18446744073709551616]}
[empty]
c 400 {"prompt": ""}
c 400 {"prompt": []}
c 400 {"prompt": [[]]}
c 400 {"prompt": [""]}
c 400 {"prompt": [[], [1]]}
h 400 {"messages": []}
h any {"messages": [{"role": "user", "content": ""}]}
[token_ids]
c 400 {"prompt": [49152]}
c 400 {"prompt": [-1]}
c 400 {"prompt": [100000000000000000000]}
c 400 {"prompt": [9223372036854775808]}
c 400 {"prompt": [18446744073709551616]}
c 400 {"prompt": [[1, 2], [1000000000]]}
c 400 {"prompt": [1.5]}
[bool_ids]
c 400 {"prompt": [true]}
c 400 {"prompt": [true, false, 5]}
c 400 {"prompt": [[true, 2]]}
c 400 {"stop_token_ids": [true]}
[surrogate]
c 400 {"prompt": "\ud800"}
c 400 {"prompt": "a\udc00b"}
c 400 {"prompt": "\udc00\ud800"}
c 400 {"prompt": ["ok", "\ud800"]}
h 400 {"messages": [{"role": "user", "content": "\ud800"}]}
c any {"stop": ["\ud800"]}
c any {"user": "\udfff"}
c 400|404 {"model": "\ud800"}
[unknown_field]
c 200 {"frobnicate": 1}
c 200 {"__proto__": {"x": 1}}
c 200 {"": ""}
c 200 {"functions": [{}]}
h 200 {"messages": [{"role": "user", "content": "Hi", "x": 1}]}
[model]
c 404 {"model": "gpt-4o"}
c 400|404 {"model": "\u0000"}
c 400|404 {"model": "$MODEL\n"}
c any {"model": ""}
"""

# Raw bodies, one a line: endpoint, answers, a Python bytes literal.
_RAW_BODIES = r"""
h 400 b'{not json'
c 400 b''
h 400 b'{'
c 400 b'{}'
h 400 b'{"prompt": "Hi",}'
c 400 b"{'prompt': 'Hi'}"
h 400 b'null'
c 400 b'[]'
h 400 b'123'
c 400 b'"prompt"'
h 400 b'{"messages": [{"role": "user", "content": "Hi"}]'
c 400 b'{"prompt": "Hi"}{"a": 1}'
c 400 b'{"prompt": "\xff\xfe"}'
c 400 b'{"prompt": "\xed\xa0\x80"}'
c 400 b'{"prompt": "Hi", "temperature": NaN}'
c 400 b'{"prompt": "Hi", "top_p": Infinity}'
c 400 b'{"prompt": "Hi", "presence_penalty": -Infinity}'
c any b'{"prompt": "a", "prompt": "b", "max_tokens": 2}'
c any b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 2}'
"""


def _table(text: str, parse_value) -> list[tuple[str, str, str, object]]:
    """(category, endpoint path, expected answers as written, value) per line of a table."""
    rows, category = [], ""
    for line in text.strip().splitlines():
        if line.startswith("["):
            category = line.strip("[]")
            continue
        endpoint, expect, value = line.split(" ", 2)
        path = COMPLETIONS if endpoint == "c" else CHAT
        rows.append((category, path, expect, parse_value(value)))
    return rows


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate goes out as \ud800


def completion_body(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, "temperature": 0, **fields}


def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _base(path: str) -> dict:
    return completion_body() if path == COMPLETIONS else chat_body()


_RANDOM_FIELDS = (
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "n", "stream", "stop", "seed", "logprobs", "top_logprobs", "echo",
    "stop_token_ids", "ignore_eos", "model", "stream_options", "presence_penalty",
    "repetition_penalty", "min_tokens", "user", "tools", "tool_choice", "response_format",
    "logit_bias", "best_of", "suffix", "x_unknown",
)  # fmt: skip
# Small ints stay small: a valid request may generate at most n x default_max_tokens tokens.
_RANDOM_VALUES = (
    None, True, False, 0, 1, 3, -1, 2**31, 2**63, 10**30, -(2**63), 0.5, 1e308, -1e-9, "",
    "x", "\ud800", "x" * 5000, [], [1], [True], [[]], ["a"], [-1], [10**9], {}, {"a": 1},
    {"type": "text"}, [{"role": "user", "content": "Hi"}], [{"role": "wizard"}],
)  # fmt: skip
_AUTH_WEIGHTS = (("good", 80), ("lower", 7), ("none", 7), ("wrong", 6))


def auth_headers(kind: str, key: str) -> list[tuple[str, str | bytes]]:
    value = {"good": f"Bearer {key}", "lower": f"bearer {key}", "upper": f"BEARER {key}",
             "wrong": f"Bearer {key}-wrong", "empty": "Bearer ", "scheme_only": "Bearer",
             "key_only": key, "basic": "Basic dXNlcjpwYXNz", "prefix": f"Bearer {key[:-1]}",
             "trailing_space": f"Bearer {key} ", "two_spaces": f"Bearer  {key}",
             "non_ascii": b"Bearer \xe9\xff", "none": None}[kind]  # fmt: skip
    return [] if value is None else [("Authorization", value)]


def _fixed_cases(key: str, model: str, context: int) -> list[Case]:
    """Every kind of hostility once, with the good key unless the case is about the key."""
    jt = [("Content-Type", "application/json")]
    good = auth_headers("good", key) + jt
    cases: list[Case] = []

    def add(name, path, body, expect=ANY, headers=good, method="POST", **kw):
        flags = {k: kw.pop(k) for k in ("half_close", "framing", "param") if k in kw}
        data = body if isinstance(body, bytes) else json_bytes(body)
        raw = http_request(method, path, data, headers, **kw)
        twins = sum(c.name == name or c.name.startswith(name + "#") for c in cases)
        cases.append(Case(name + (f"#{twins + 1}" if twins else ""), raw, expect, **flags))

    def fill(text: str) -> dict:
        return json.loads(
            text.replace("$MODEL", json.dumps(model)[1:-1]).replace("$CONTEXT", str(context))
        )

    for category, path, answers, fields in _table(_MUTATIONS, fill):
        where = "chat" if path == CHAT else "cmpl"
        expect, param = _expect_param(answers)
        name = f"{category}:{where}:{json.dumps(fields)[:60]}"
        add(name, path, {**_base(path), **fields}, expect, param=param)
    for _, path, answers, body in _table(_RAW_BODIES, ast.literal_eval):
        add(f"bad_json:{body[:40]!r}", path, body, _expect(answers))
    # too big to write out: beyond the context, the body limit (4 MiB), a nesting limit
    add(
        "huge:prompt_context_words",
        COMPLETIONS,
        completion_body(prompt="hello " * context),
        _expect("400"),
    )
    add(
        "huge:prompt_context_ids",
        COMPLETIONS,
        completion_body(prompt=[1] * context),
        _expect("400"),
    )
    add(
        "huge:context_messages",
        CHAT,
        chat_body(messages=chat_body()["messages"] * context),
        _expect("400"),
    )
    # past the server's per-request limits (server/limits.py): refused before any work
    stops = [f"s{i}" for i in range(10_000)]
    add("huge:stop_10k", COMPLETIONS, completion_body(stop=stops), _expect("400"), param="stop")
    add("huge:stop_300_chars", COMPLETIONS, completion_body(stop=["s" * 300]), _expect("400"),
        param="stop.0")  # fmt: skip
    ids = list(range(1000))
    add("huge:stop_token_ids_1000", COMPLETIONS, completion_body(stop_token_ids=ids),
        _expect("400"), param="stop_token_ids")  # fmt: skip
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]
    add("huge:tools_200", CHAT, chat_body(tools=tools), _expect("400"), param="tools")
    prompt = "hello " * 400_000  # 2.4 M characters: past max_prompt_chars, inside the body limit
    add("huge:prompt_chars", COMPLETIONS, completion_body(prompt=prompt), _expect("400"),
        param="prompt")  # fmt: skip
    digits = b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"
    # JSON, not for int(): a number longer than Python reads is a 400 at its field
    add("number:5000_digits", COMPLETIONS, digits, _expect("400"), param="max_tokens")
    digits = b'{"prompt": "Hi", "max_tokens": 2, "temperature": 0.' + b"1" * 5000 + b"}"
    add("number:5000_digit_fraction", COMPLETIONS, digits, _expect("200"))
    add(
        "unknown_field:100k_list",
        COMPLETIONS,
        {**completion_body(), "x": [0] * 100_000},
        _expect("200"),
    )
    add(
        "unknown_field:long_name", COMPLETIONS, {**completion_body(), "p" * 1000: 1}, _expect("200")
    )
    add("bad_json:nested_100k", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, _expect("400"))
    for n in (1000, 100_000, 3_000_000):
        add(f"model:{n}_chars", COMPLETIONS, completion_body(model="m" * n), _expect("404"))
    add("model:5M_chars", COMPLETIONS, completion_body(model="m" * 5_000_000), _expect("413|reset"))
    add(
        "body:5MB_prompt",
        COMPLETIONS,
        completion_body(prompt="x" * 5_000_000),
        _expect("413|reset"),
    )
    # content types: JSON under another name (or none) is read or refused with 415, never 5xx
    body, auth = json_bytes(completion_body()), auth_headers("good", key)

    def typed(value: str) -> list[tuple[str, str | bytes]]:
        return auth + [("Content-Type", value)]

    add("content_type:text_plain", COMPLETIONS, body, headers=typed("text/plain"))
    add("content_type:none", COMPLETIONS, body, headers=auth)
    utf16 = json.dumps(completion_body()).encode("utf-16")
    add("content_type:utf16", COMPLETIONS, utf16, headers=typed("application/json; charset=utf-16"))
    form = typed("application/x-www-form-urlencoded")
    add("content_type:form", COMPLETIONS, b"prompt=Hi&max_tokens=2", _expect("400|415"), form)
    multipart = typed("multipart/form-data; boundary=x")
    add("content_type:multipart", COMPLETIONS, b"--x\r\n\r\n--x--", _expect("400|415"), multipart)
    # Content-Length that lies, and chunked bodies
    shorter = str(len(body) - 5)
    add("content_length:shorter", COMPLETIONS, body, _expect("400"), content_length=shorter)
    add("content_length:zero", COMPLETIONS, body, _expect("400"), content_length="0")
    add("content_length:1e12", COMPLETIONS, body, _expect("413"), content_length=str(10**12))
    longer = str(len(body) + 100)
    add("content_length:longer_then_eof", COMPLETIONS, body, _expect("400|closed"),
        content_length=longer, half_close=True)  # fmt: skip
    for name, value in (("letters", "abc"), ("negative", "-5"), ("two_values", "5, 7")):
        add(f"content_length:{name}", COMPLETIONS, body, _expect("400"),
            content_length=value, framing=True)  # fmt: skip
    chunked = typed("application/json") + [("Transfer-Encoding", "chunked")]
    # a body that is not chunked leaves h11 waiting for a chunk-size line: EOF ends the wait
    add("content_length:and_chunked", COMPLETIONS, body, _expect("400|closed"), chunked,
        half_close=True, framing=True)  # fmt: skip
    add("chunked:valid", COMPLETIONS, b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
        _expect("200"), chunked, content_length=False)  # fmt: skip
    add("chunked:bad_size", COMPLETIONS, b"zz\r\n" + body, _expect("400|closed"), chunked,
        content_length=False, framing=True)  # fmt: skip
    # routes, methods and framing
    for name, method, path, expect in (
        ("route:get_completions", "GET", COMPLETIONS, "405"),
        ("route:post_models", "POST", "/v1/models", "405"),
        ("route:delete_models", "DELETE", "/v1/models", "405"),
        ("route:unknown", "GET", "/v1/nope", "404"),
        ("route:typo", "POST", "/v1/chat/completion", "404"),
        ("route:dotdot", "GET", "/v1/../../etc/passwd", "404"),
        ("route:method_brew", "BREW", "/v1/models", "any"),
        ("route:query_string", "POST", COMPLETIONS + "?x=1", "200"),
        ("route:models", "GET", "/v1/models", "200"),
        ("route:metrics", "GET", "/metrics", "200"),
    ):
        add(name, path, body if method == "POST" else b"", _expect(expect), method=method)
    add("framing:long_path", "/" + "a" * 20_000, b"", method="GET", framing=True)
    add("framing:no_host", COMPLETIONS, body, host=False, framing=True)
    big, many = auth + [("X-Big", "b" * 100_000)], auth + [(f"X-{i}", "v") for i in range(1000)]
    add("framing:100KB_header", "/v1/models", b"", headers=big, method="GET", framing=True)
    add("framing:1000_headers", "/v1/models", b"", headers=many, method="GET", framing=True)
    cases.append(Case("framing:garbage", bytes(range(256)) * 4, framing=True))
    http10 = http_request("GET", "/v1/models", b"", auth).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    cases.append(Case("framing:http10", http10, _expect("200")))
    expect_100 = good + [("Expect", "100-continue")]
    add("framing:expect_continue", COMPLETIONS, body, _expect("200"), headers=expect_100)
    # the API key: RFC 7235 makes the scheme case-insensitive, so "bearer" is a valid spelling
    for kind, expect in (("lower", "200"), ("upper", "200"), ("none", "401"), ("wrong", "401"),
                         ("empty", "401"), ("scheme_only", "401"), ("key_only", "401"),
                         ("basic", "401"), ("prefix", "401"), ("non_ascii", "401"),
                         ("trailing_space", "any"), ("two_spaces", "any")):  # fmt: skip
        add(
            f"auth:{kind}", COMPLETIONS, body, _expect(expect), headers=auth_headers(kind, key) + jt
        )
    add("auth:two_headers", COMPLETIONS, body, headers=[("Authorization", "Bearer x"), *good])
    add("auth:metrics_without_key", "/metrics", b"", _expect("401"), headers=[], method="GET")
    add("auth:health_without_key", "/health", b"", _expect("200"), headers=[], method="GET")
    lower = auth_headers("lower", key)
    add("auth:models_bearer_lower", "/v1/models", b"", _expect("200"), lower, method="GET")
    big_body = completion_body(prompt="x" * 5_000_000)
    add("auth:none_5MB_body", COMPLETIONS, big_body, _expect("401|413|reset"), headers=jt)
    return cases


def build_corpus(seed: int, n: int, key: str, model: str, context: int) -> list[Case]:
    """The fixed cases topped up to `n` with random field mutations under random keys, then
    shuffled; the same seed gives the same bytes in the same order."""
    rng = random.Random(seed)
    cases = _fixed_cases(key, model, context)
    kinds, weights = zip(*_AUTH_WEIGHTS)
    for i in range(max(0, n - len(cases))):
        path = rng.choice((COMPLETIONS, CHAT))
        body = _base(path)
        for field in rng.sample(_RANDOM_FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(_RANDOM_VALUES)
        auth = rng.choices(kinds, weights)[0]
        expect = _expect("401") if auth in ("none", "wrong") else ANY
        headers = auth_headers(auth, key) + [("Content-Type", "application/json")]
        raw = http_request("POST", path, json_bytes(body), headers)
        cases.append(Case(f"random:{i}:{auth}", raw, expect))
    rng.shuffle(cases)
    return cases


# -- responses, tallies and the verdict (pure) ---------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    status: str  # "200", "400", ... or "closed" (no answer, then EOF), "reset", "hang"
    seconds: float
    body: bytes = b""


def parse_response(data: bytes) -> tuple[str, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of one raw HTTP/1.1 response read to EOF; a chunked
    body is decoded. No bytes: ("closed", {}, b"")."""
    if not data:
        return "closed", {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    match = re.match(r"HTTP/\d(?:\.\d)? (\d{3})", lines[0])
    if not match:
        return "garbled", {}, data
    if match.group(1).startswith("1") and body:  # 100 Continue: the answer follows
        return parse_response(body)
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                break
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return match.group(1), headers, body


def error_shape_ok(body: bytes) -> bool:
    """OpenAI's error JSON: {"error": {"message": non-empty str, "type", "param", "code"}}."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict)
        and {"message", "type", "param", "code"} <= set(err)
        and isinstance(err["message"], str)
        and bool(err["message"])
    )


def error_param(body: bytes) -> str | None:
    """The error.param of an answer in OpenAI's error shape (None in any other body)."""
    try:
        param = json.loads(body)["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
    return param if isinstance(param, str) else None


def _surprise(case: Case, outcome: Outcome) -> bool:
    if outcome.status == "hang":  # a must-hold of its own
        return False
    if case.expect and outcome.status not in case.expect:
        return True
    return case.param is not None and error_param(outcome.body) != case.param


def tally(results: Sequence[tuple[Case, Outcome]]) -> dict:
    """Counts by status, every 5xx and hang (must-holds), answers other than expected (the
    status, or the field an error names) and error bodies not in OpenAI's shape (warnings)."""
    by_status = Counter(o.status for _, o in results)
    five_xx = [c.name for c, o in results if o.status.startswith("5")]
    hangs = [c.name for c, o in results if o.status == "hang"]
    unexpected = [
        {
            "case": c.name,
            "expected": sorted(c.expect) + ([f"param {c.param}"] if c.param else []),
            "got": o.status + (f" param {error_param(o.body)}" if c.param else ""),
            "body": o.body[:200].decode("utf-8", "replace"),
        }
        for c, o in results
        if _surprise(c, o)
    ]
    bad_shape = [
        c.name
        for c, o in results
        if not c.framing
        and o.status[:1] in "45"
        and o.status.isdigit()
        and not error_shape_ok(o.body)
    ]
    return {
        "n_requests": len(results),
        "requests_by_status": dict(sorted(by_status.items())),
        "n_5xx": len(five_xx),
        "five_xx": five_xx,
        "n_hangs": len(hangs),
        "hangs": hangs,
        "n_unexpected": len(unexpected),
        "unexpected": unexpected,
        "n_bad_error_shape": len(bad_shape),
        "bad_error_shape": bad_shape,
        "slowest_s": round(max((o.seconds for _, o in results), default=0.0), 3),
        "outcomes": {c.name: o.status for c, o in sorted(results, key=lambda r: r[0].name)},
    }


STALL_P99_S = 0.2  # /health's p99 latency while large inputs are tokenized, at most
STOP_GAP_RATIO = 1.5  # another stream's inter-token gap beside the largest stop list, at most
HEAD_SLACK_S = 2.0  # past header_timeout, how late a loaded machine may close a connection


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile of `values` (the nearest rank at or above), rounded to 0.1 ms."""
    if not values:
        return None
    ranked = sorted(values)
    return round(ranked[min(int(q * len(ranked)), len(ranked) - 1)], 4)


def verdict(r: dict) -> tuple[list[str], list[str]]:
    """(failures, warnings) of a soak result. A failure is a must-hold that broke; a missing
    figure (its phase never ran) is a failure too."""
    fail, warn = [], []
    seen = r.get("cache_blocks_seen")
    if seen is None or seen != r.get("num_blocks"):
        fail.append(
            f"free KV blocks at start {seen} != the configured {r.get('num_blocks')}: the small "
            "cache did not take (or /metrics has no outrider:num_free_kv_blocks)"
        )
    fuzz = r.get("fuzz", {})
    if r.get("n_5xx") is None or r.get("n_hangs") is None:
        fail.append("the fuzz phase did not run to its end")
    if r.get("n_5xx"):
        fail.append(f"{r['n_5xx']} fuzz request(s) got a 5xx: {fuzz.get('five_xx')}")
    if r.get("n_hangs"):
        fail.append(f"{r['n_hangs']} fuzz request(s) hung: {fuzz.get('hangs')}")
    if r.get("leaked_blocks") != 0:
        fail.append(f"leaked KV blocks: {r.get('leaked_blocks')} (by phase {r.get('kv_free')})")
    done, total = r.get("oversubscribed_completed"), r.get("oversubscribed_total")
    if not total or done != total:
        fail.append(f"oversubscription: {done}/{total} completed with max_tokens tokens")
    if r.get("sigterm_streams_clean") != r.get("sigterm_streams") or not r.get("sigterm_streams"):
        fail.append(
            f"SIGTERM: {r.get('sigterm_streams_clean')}/{r.get('sigterm_streams')} "
            "streams ended cleanly"
        )
    if r.get("exit_code") != 0:
        fail.append(f"exit code after SIGTERM: {r.get('exit_code')} (want 0)")
    p99, requests = r.get("stall_health_p99_s"), r.get("stall_requests") or []
    if p99 is None or p99 > STALL_P99_S:
        fail.append(
            f"loop stall: /health p99 {p99} s while large inputs were tokenized (want <= "
            f"{STALL_P99_S} s; idle p99 {r.get('stall_idle_health_p99_s')} s)"
        )
    tokenized = [q for q in requests if q["path"] == "/tokenize"]
    if not tokenized or any(q["status"] != "200" for q in tokenized):
        fail.append(f"loop stall: large /tokenize answers {[q['status'] for q in tokenized]}")
    if set(r.get("stall_health_statuses") or {}) - {"200"}:
        fail.append(f"loop stall: /health answered {r['stall_health_statuses']}")
    fail += _attack_failures(r)
    if fuzz.get("n_unexpected"):
        warn.append(f"{fuzz['n_unexpected']} fuzz answer(s) differ from the expected status")
    if fuzz.get("n_bad_error_shape"):
        warn.append(f"{fuzz['n_bad_error_shape']} error body(ies) not in OpenAI's error shape")
    if r.get("outputs_equal_sequential") is False:
        warn.append(
            f"oversubscribed outputs differ from one-at-a-time runs: {r.get('outputs_differ')}"
        )
    if r.get("preemptions") == 0:
        warn.append("no preemption happened: the oversubscription did not oversubscribe")
    if r.get("abort_streams_saw_content") != r.get("abort_streams"):
        warn.append(
            f"only {r.get('abort_streams_saw_content')}/{r.get('abort_streams')} aborted "
            "streams saw content before hanging up"
        )
    for name, want in (("health_while_draining", "503"), ("request_while_draining", "503")):
        if r.get(name) not in (want, "refused"):
            warn.append(f"{name}: got {r.get(name)}, want {want}")
    if r.get("sigterm_streams_done") != r.get("sigterm_streams"):
        warn.append(
            f"{r.get('sigterm_streams_done')}/{r.get('sigterm_streams')} SIGTERM streams "
            "got data: [DONE]"
        )
    refused = [q["status"] for q in r.get("stall_requests") or () if q["path"] != "/tokenize"]
    if any(status != "400" for status in refused):
        warn.append(f"loop stall: prompts beyond the context answered {refused}, want 400")
    if r.get("server_tracebacks"):
        warn.append(f"{r['server_tracebacks']} traceback(s) in the server log")
    heads = r.get("heads_statuses") or {}
    if heads and (heads.get("partial") != ["408"] or heads.get("silent", ["closed"]) != ["closed"]):
        warn.append(f"slow heads: closed with {heads}, want 408 for a begun head, else nothing")
    if r.get("forged_chat_status") not in (None, "200"):
        warn.append(f"forged role markers: the chat request answered {r['forged_chat_status']}")
    return fail, warn


def _attack_failures(r: dict) -> list[str]:
    """The must-holds of the attacks on the server's bounds (soak_attacks.py)."""
    fail = []
    ratio, gaps = r.get("stop_gap_ratio"), r.get("stop_gap_median_ms") or {}
    if ratio is None or ratio > STOP_GAP_RATIO:
        fail.append(
            f"stop list: another stream's inter-token gap beside {r.get('stop_list_strings')} "
            f"stop strings of {r.get('stop_list_chars')} characters is {ratio} x its gap beside "
            f"a stream without (want <= {STOP_GAP_RATIO}; medians {gaps} ms)"
        )
    statuses = r.get("stop_attack_statuses") or []
    if not statuses or set(statuses) != {"200"}:
        fail.append(f"stop list: the largest stop list the server takes answered {statuses}")
    over = r.get("stop_over_limit") or {}
    if not over or any(v.get("status") != "400" for v in over.values()):
        fail.append(f"stop list: requests past the stop limits answered {over}, want 400")
    held, closed, late = r.get("heads_held"), r.get("heads_closed"), r.get("heads_close_max_s")
    most = (r.get("header_timeout_s") or 0) + HEAD_SLACK_S
    if not held or closed != held or late is None or late > most:
        fail.append(
            f"slow heads: {closed}/{held} connections without a whole request head closed by "
            f"the server, the last after {late} s (want all, within {most} s)"
        )
    cap = [r.get(k) for k in ("cap_request_beyond", "cap_health", "cap_request_after")]
    if cap != ["503", "200", "200"]:
        fail.append(
            f"connection cap: a request beyond it {cap[0]} (want 503), /health {cap[1]} (want "
            f"200), a request once those connections were closed {cap[2]} (want 200)"
        )
    forged, live = r.get("forged_control_tokens"), r.get("forged_plain_control_tokens")
    if forged != 0:
        fail.append(f"forged role markers: {forged} control token(s) forged by a user message")
    if not live:
        fail.append(
            f"forged role markers: the forged text holds {live} control tokens even as a plain "
            "prompt: no marker of this model's template was recognised, the check proves nothing"
        )
    return fail


def summary(r: dict) -> list[str]:
    """The printed report of a soak result; a figure whose phase never ran prints as None."""
    g, fuzz = r.get, r.get("fuzz", {})
    lines = [
        f"soak (spec {g('spec')}) in {g('phases_s', {}).get('total')} s",
        f"  fuzz {fuzz.get('n_requests')} requests: {g('requests_by_status')}; 5xx {g('n_5xx')}, "
        f"hangs {g('n_hangs')}, unexpected {fuzz.get('n_unexpected')}, bad error shape "
        f"{fuzz.get('n_bad_error_shape')}",
        f"  KV free blocks by phase {g('kv_free')}; leaked {g('leaked_blocks')}",
        f"  oversubscribed {g('oversubscribed_completed')}/{g('oversubscribed_total')} complete "
        f"(need {g('kv_blocks_needed')} of {g('num_blocks')} blocks; preemptions "
        f"{g('preemptions')}); equal to one at a time: {g('outputs_equal_sequential')}",
        f"  loop stall: {g('stall_parallel')} x /tokenize of {g('stall_prompt_chars')} "
        f"characters: /health p50 {g('stall_health_p50_s')} s, p99 {g('stall_health_p99_s')} s, "
        f"max {g('stall_health_max_s')} s over {g('stall_health_polls')} polls (idle p99 "
        f"{g('stall_idle_health_p99_s')} s)",
        f"  stop list ({g('stop_list_strings')} x {g('stop_list_chars')} characters): "
        f"inter-token gap medians {g('stop_gap_median_ms')} ms, beside the attack / beside a "
        f"plain stream {g('stop_gap_ratio')}; past the limits {g('stop_over_limit')}",
        f"  forged role markers: {g('forged_control_tokens')} forged control tokens "
        f"({g('forged_plain_control_tokens')} in the same text as a plain prompt)",
        f"  slow heads: {g('heads_closed')}/{g('heads_held')} closed within "
        f"{g('heads_close_min_s')}-{g('heads_close_max_s')} s (header_timeout "
        f"{g('header_timeout_s')} s) {g('heads_statuses')}; beyond the connection cap "
        f"{g('cap_request_beyond')}, /health {g('cap_health')}, after {g('cap_request_after')}",
        f"  SIGTERM: drain {g('drain_seconds')} s, exit code {g('exit_code')}, "
        f"{g('sigterm_streams_clean')}/{g('sigterm_streams')} streams clean "
        f"{g('sigterm_finish_reasons')}",
        f"  outrider --help {g('help_seconds')} s (median); phases (s) {g('phases_s')}",
    ]
    for u in fuzz.get("unexpected", [])[:40]:
        lines.append(f"  unexpected: {u['case']}: want {u['expected']}, got {u['got']}: "
                     f"{u['body'][:100]!r}")  # fmt: skip
    lines += [f"  WARNING: {w}" for w in r.get("warnings", [])]
    lines += [f"  FAIL: {f}" for f in r.get("failures", [])]
    return lines


def traceback_exceptions(log: str) -> dict[str, int]:
    """How often each exception ends a traceback in a log: the first unindented line after
    `Traceback (most recent call last):`."""
    found, inside = Counter(), False
    for line in log.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line and not line[0].isspace():
            found[line.strip()[:160]] += 1
            inside = False
    return dict(found)


def metric_values(text: str, names: Sequence[str]) -> dict[str, float | None]:
    """The sum over label sets of each named Prometheus sample (None when absent)."""
    out: dict[str, float | None] = dict.fromkeys(names)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in out:
            out[name] = (out[name] or 0.0) + float(line.rsplit(" ", 1)[1])
    return out
