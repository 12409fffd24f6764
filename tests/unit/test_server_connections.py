"""Connection hygiene against a live server on loopback (ServerThread over the scripted engine and
the word-level tokenizer), with raw sockets: a connection that does not finish its request head
within header_timeout is closed (408 when it had begun one), however it idles; a request on a
connection beyond max_connections gets 503 JSON and its connection closes; a POST beyond
max_concurrent_requests gets 503 JSON. /health stays reachable through all of it."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.unit.test_server_async_engine import FakeCore
from tests.unit.test_server_errors_unit import AUTH, KEY, _tokenizer

HEADER_TIMEOUT = 1.0


@contextlib.contextmanager
def serving(**config) -> Iterator:
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = FakeCore(tokens=2)
    core.tokenizer = _tokenizer()
    with ServerThread(ServerConfig(api_key=KEY, served_model_name="fake", **config), core) as s:
        yield s


def _connect(s) -> socket.socket:
    return socket.create_connection(("127.0.0.1", s.port), timeout=10)


def _read_to_close(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def _read_response(sock: socket.socket) -> tuple[bytes, dict]:
    """One response with a Content-Length: its head, and its body as JSON."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(v for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n"))
                      if k.lower() == b"content-length"))  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head, json.loads(body)


def _error(data: bytes, status: int) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), data[:300]
    assert b"application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _request(path: str, body: bytes = b"", method: str = "POST") -> bytes:
    auth = AUTH["Authorization"].encode()
    head = b"%s %s HTTP/1.1\r\nHost: t\r\nAuthorization: %s\r\n" % (method.encode(), path, auth)
    if method == "POST":
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


@pytest.fixture(scope="module")
def server():
    with serving(header_timeout=HEADER_TIMEOUT) as s:
        yield s


def test_a_head_sent_slowly_is_closed_with_408_within_the_timeout(server):
    socks = [_connect(server) for _ in range(20)]
    for i, sock in enumerate(socks):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: %d" % i)
    time.sleep(0.3)
    socks[0].sendall(b"\r\nX-More: 1")  # still dribbling: the timeout runs from the start
    for sock in socks:
        with sock:
            data, waited = _read_to_close(sock)
        assert waited < HEADER_TIMEOUT + 2.0
        assert "did not arrive within 1 s" in _error(data, 408)["message"]
    deadline = time.monotonic() + 5
    while server.server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.server.server_state.connections  # the server holds none of them


def test_a_silent_connection_is_closed_without_an_answer(server):
    with _connect(server) as sock:
        data, waited = _read_to_close(sock)
    assert data == b"" and waited < HEADER_TIMEOUT + 2.0


def test_a_kept_alive_connection_gets_the_timeout_for_its_next_head(server):
    with _connect(server) as sock:
        sock.sendall(_request(b"/health", method="GET"))
        head, _ = _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
        sock.sendall(b"GET /hea")
        data, waited = _read_to_close(sock)
    _error(data, 408)
    assert waited < HEADER_TIMEOUT + 2.0


def test_a_slow_body_after_a_whole_head_is_not_cut_by_the_header_timeout(server):
    body = json.dumps({"prompt": "hi there"}).encode()
    with _connect(server) as sock:
        sock.sendall(_request(b"/tokenize", body)[: -len(body) + 3])
        time.sleep(HEADER_TIMEOUT + 0.5)
        sock.sendall(body[3:])
        head, answer = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert answer["tokens"] == _tokenizer().encode("hi there")


def test_requests_beyond_max_connections_get_503_and_are_closed():
    with serving(max_connections=2) as s:
        idle = [_connect(s), _connect(s)]
        try:
            time.sleep(0.2)
            with _connect(s) as third:
                third.sendall(_request(b"/v1/models", method="GET"))
                data, _ = _read_to_close(third)  # closed after the answer
            assert "2" in _error(data, 503)["message"]
            assert httpx.get(s.base + "/health").status_code == 200  # probes still get through
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 5
        while len(s.server.server_state.connections) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(s.url + "/models", headers=AUTH).status_code == 200


def test_posts_beyond_max_concurrent_requests_get_503():
    with serving(max_concurrent_requests=1) as s:
        body = json.dumps({"prompt": "hi"}).encode()
        with _connect(s) as uploading:  # in flight from its head until its answer
            uploading.sendall(_request(b"/tokenize", body)[:-2])
            time.sleep(0.3)
            r = httpx.post(s.base + "/tokenize", json={"prompt": "hi"}, headers=AUTH)
            assert r.status_code == 503 and "max_concurrent_requests" in r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert httpx.get(s.base + "/health").status_code == 200
            uploading.sendall(body[-2:])
            assert _read_response(uploading)[0].startswith(b"HTTP/1.1 200")
        r = httpx.post(s.base + "/tokenize", json={"prompt": "hi"}, headers=AUTH)
        assert r.status_code == 200
