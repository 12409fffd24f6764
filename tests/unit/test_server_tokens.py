"""vLLM's /tokenize, /detokenize and /version on the real app (scripted engine, word-level
tokenizer): a prompt and messages tokenize as the completion endpoints see them, ids decode
back, and bad input is a 400 naming the field."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from outrider import __version__
from outrider.server.offload import INLINE_BYTES
from tests.unit.test_server_errors_unit import AUTH, KEY, _tokenizer, app  # noqa: F401


@pytest.fixture(scope="module")
def client(app):  # noqa: F811
    return TestClient(app, headers=AUTH)


def test_tokenize_a_prompt_and_detokenize_it_back(client):
    tok = _tokenizer()
    r = client.post("/tokenize", json={"model": "fake", "prompt": "hi there"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("hi there") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    back = client.post("/detokenize", json={"model": "fake", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(body["tokens"], False)


def test_tokenize_messages_as_the_chat_endpoint_renders_them(client):
    tok = _tokenizer()
    messages = [{"role": "user", "content": "hi there"}]
    r = client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert len(r.json()["token_strs"]) == r.json()["count"]


def test_a_large_prompt_tokenizes_off_the_loop_as_a_small_one_does(client):
    tok = _tokenizer()
    prompt = "hi there user " * 2000  # past INLINE_BYTES: tokenized in the offload pool
    assert len(prompt) > INLINE_BYTES
    r = client.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == [tok.decode([i], False) for i in body["tokens"]]
    back = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(body["tokens"], False)
    bad = client.post("/detokenize", json={"tokens": [*body["tokens"], 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ],
)
def test_bad_tokenize_requests_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_and_missing_key(client, app):  # noqa: F811
    assert client.post("/tokenize", json={"model": "other", "prompt": "hi"}).status_code == 404
    assert TestClient(app).post("/detokenize", json={"tokens": [1]}).status_code == 401
    assert KEY


def test_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
