"""`outrider serve` as systemd runs it, in a subprocess: READY=1 on $NOTIFY_SOCKET once warm;
on SIGTERM, STOPPING=1, new requests get 503, in-flight requests that fit the shutdown timeout
finish, the rest are aborted when it expires, and the process exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


SHUTDOWN_TIMEOUT = 4.0


def _read_notify(sock: socket.socket, want: str, timeout: float) -> list[str]:
    sock.settimeout(timeout)
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if any(want in m.splitlines() for m in seen):
            return seen
    raise AssertionError(f"{want!r} never reached NOTIFY_SOCKET; got {seen}")


@pytest.fixture()
def served(tmp_path):
    notify_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    config = tmp_path / "server.yaml"
    config.write_text(
        "server:\n"
        "  host: 127.0.0.1\n"
        "  port: 0\n"
        f"  shutdown_timeout: {SHUTDOWN_TIMEOUT}\n"
        "model:\n"
        "  dtype: float32\n"
        "  device: cpu\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "outrider", "serve", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NOTIFY_SOCKET": notify_path},
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"the server exited with {proc.returncode}"
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        yield proc, f"http://127.0.0.1:{port}", notify
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def _stream(base: str, max_tokens: int, results: list, started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    tokens, reason = 0, None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += 1
            started.set()
            reason = choice["finish_reason"] or reason
    results.append((max_tokens, tokens, reason))


def test_sigterm_drains_then_exits_zero(served):
    proc, base, notify = served
    assert any("READY=1" in m for m in _read_notify(notify, "READY=1", 10))
    assert httpx.get(base + "/health").status_code == 200
    # Short requests finish well within the timeout; long ones cannot and get aborted.
    results: list = []
    threads = []
    for max_tokens in (8, 8, 4000):
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(base, max_tokens, results, started))
        t.start()
        assert started.wait(30)
        threads.append(t)
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _read_notify(notify, "STOPPING=1", 10)
    health = httpx.get(base + "/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert refused.status_code == 503
    assert "shutting down" in refused.json()["error"]["message"]
    for t in threads:
        t.join(SHUTDOWN_TIMEOUT + 20)
    assert proc.wait(timeout=SHUTDOWN_TIMEOUT + 20) == 0
    elapsed = time.monotonic() - t_term
    assert SHUTDOWN_TIMEOUT <= elapsed < SHUTDOWN_TIMEOUT + 15
    by_len = sorted(results)
    assert [(m, r) for m, _, r in by_len] == [(8, "length"), (8, "length"), (4000, "abort")]
    assert by_len[0][1] == by_len[1][1] == 8  # every short request's tokens arrived
    assert 0 < by_len[2][1] < 4000
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def test_a_client_still_uploading_at_sigterm_gets_503_json(served):
    proc, base, notify = served
    _read_notify(notify, "READY=1", 10)
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=20) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "'
        )
        time.sleep(0.5)  # the request is in; its body is not
        proc.send_signal(signal.SIGTERM)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head, data[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "shutting down" in error["message"]
    assert proc.wait(timeout=SHUTDOWN_TIMEOUT + 20) == 0  # nothing else was in flight
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr


def test_sigint_during_the_drain_cuts_requests_off_and_exits_130(served):
    proc, base, notify = served
    _read_notify(notify, "READY=1", 10)
    started = threading.Event()

    def stream() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off: what this test is about
            _stream(base, 4000, [], started)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    proc.send_signal(signal.SIGTERM)
    _read_notify(notify, "STOPPING=1", 10)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 130
    t.join(20)
