"""A streamed event stays one line for every client: token text holding a character that
str.splitlines counts as a line break (U+0085, U+2028, U+2029), which httpx's iter_lines and
many other clients split on, reaches them escaped, and the JSON still reads back the same text."""

from __future__ import annotations

import dataclasses
import json

import pytest
from starlette.testclient import TestClient

from outrider.core import RequestOutput
from outrider.server.serving import sse
from tests.unit.test_server_async_engine import FakeCore
from tests.unit.test_server_errors_unit import AUTH, fake_app

BREAKS = "a\x85b\u2028c\u2029d\x1ce\x0bf\rg\nh"


class BreakingCore(FakeCore):
    """FakeCore whose every delta is BREAKS."""

    def step(self) -> list[RequestOutput]:
        return [dataclasses.replace(o, text=BREAKS) for o in super().step()]


def test_sse_event_is_one_line_and_reads_back():
    event = sse({"text": BREAKS})
    lines = event.splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: {"), lines
    assert json.loads(lines[0][6:]) == {"text": BREAKS}
    assert sse("[DONE]") == "data: [DONE]\n\n"


@pytest.fixture()
def client():
    with fake_app(BreakingCore(tokens=3)) as app:
        yield TestClient(app, headers=AUTH)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_streamed_text_with_line_breaks_arrives_whole(client, path, body):
    with client.stream("POST", path, json={"model": "fake", "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
    chunks = [json.loads(line[6:])["choices"] for line in lines[:-1]]
    texts = [c[0].get("text", c[0].get("delta", {}).get("content")) for c in chunks if c]
    assert "".join(t for t in texts if t) == BREAKS * 3


@pytest.mark.parametrize("usage_null", [False, True])
@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "text": " the", "logprobs": None, "finish_reason": None},
        {"index": 3, "text": BREAKS + '"\\\x00é漢🙂', "logprobs": None, "finish_reason": "length"},
        {
            "index": 1,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        },  # fmt: skip
        {
            "index": 0,
            "delta": {"reasoning_content": "hm\u2028", "content": BREAKS},
            "logprobs": None,
            "finish_reason": "stop",
        },  # fmt: skip
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
        # json writes these itself
        {
            "index": 0,
            "text": "a",
            "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]},
            "finish_reason": None,
        },  # fmt: skip
        {
            "index": 0,
            "delta": {"tool_calls": [{"index": 0, "id": "c"}]},
            "logprobs": None,
            "finish_reason": "tool_calls",
        },  # fmt: skip
        {"index": True, "text": "a", "logprobs": None, "finish_reason": None},
        {
            "index": 0,
            "delta": {"content": "a"},
            "logprobs": {"content": [{"logprob": -1.25}]},
            "finish_reason": None,
        },  # fmt: skip
    ],
)
def test_stream_events_are_the_chunks_json_would_write(choice, usage_null):
    """StreamEvents writes each chunk as sse(response(...)) does, byte for byte: text and
    deltas written out directly (line breaks escaped, quotes, backslashes, non-ASCII) and
    everything else through json."""
    from types import SimpleNamespace

    from outrider.server.serving import StreamEvents, response

    state = SimpleNamespace(model_name='m\u2028"odel')
    extra = {"usage": None} if usage_null else {}
    events = StreamEvents(state, "cmpl-1", "text_completion", 1765000000, usage_null)
    for choices in ([choice], [choice, choice], []):
        want = sse(response(state, "cmpl-1", "text_completion", choices, 1765000000, **extra))
        got = events.chunk(choices)
        assert got == want
        assert len(got.splitlines()) == 2 and json.loads(got[len("data: ") :]) == json.loads(
            want[len("data: ") :]
        )
