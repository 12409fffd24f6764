"""One streamed request to an OpenAI-compatible endpoint, timed as `vllm bench serve` times it:
TTFT at the first chunk with text, ITL between chunks with text, the output's tokens from the
server's usage (one a chunk where it sends none)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0  # s, sent -> end of stream
    ttft: float | None = None  # s
    itl: list[float] = field(default_factory=list)  # s, between chunks with text
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage; None when the server sent none
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def send_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """Stream one request, timing each chunk that carries text as it arrives."""
    import httpx

    chunks, usage = 0, None
    start = last = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {_message(text)}")
            async for line in sse_lines(r):
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    continue  # read on to the body's end: a response left unread loses its
                    # connection, and every request would pay a new one in its TTFT
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"error in stream: {_message(data)}"
                    return res
                usage = obj.get("usage") or usage
                if _chunk_text(obj):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if usage:
        res.output_tokens = usage.get("completion_tokens") or chunks
        res.prompt_tokens = usage.get("prompt_tokens")
    else:
        res.output_tokens = chunks
    if res.ttft is None:
        res.error = "the stream ended without any text"
        return res
    res.ok = True
    return res


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """A server-sent event stream's lines, broken where SSE breaks them: at CRLF, LF or CR and
    nowhere else. httpx's aiter_lines breaks where str.splitlines does, U+2028 and U+0085
    included, which vLLM and SGLang leave raw in their JSON: a token holding one would cut its
    event in two."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        cr = pending.endswith("\r")  # it may be the first half of a CRLF: held back
        lines = _SSE_BREAK.split(pending[:-1] if cr else pending)
        pending = lines.pop() + ("\r" if cr else "")
        for line in lines:
            yield line
    if pending:
        yield pending.removesuffix("\r")


_SSE_BREAK = re.compile(r"\r\n|\r|\n")


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or [{}]
    c = choices[0]
    delta = c.get("delta") or {}
    return c.get("text") or delta.get("content") or delta.get("reasoning_content") or ""


def _message(body: str) -> str:
    """An OpenAI error body's message (else the body itself), clipped."""
    try:
        err = json.loads(body).get("error")
        body = err.get("message", body) if isinstance(err, dict) else str(err or body)
    except (json.JSONDecodeError, AttributeError):
        pass
    return body.strip()[:200]
