"""What both completion endpoints share: parsing the body, turning request fields into
SamplingParams, logprobs in OpenAI's shapes, SSE framing, and watching for a client that left."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import sys
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring as _encode_str  # json.dumps's, ensure_ascii=False
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from outrider.core import SamplingParams
from outrider.server.errors import APIError, bad_request, clip, from_validation_error
from outrider.server.protocol import SamplingFields
from outrider.server.state import ServerState
from outrider.server.structured import Constraint

M = TypeVar("M", bound=BaseModel)
_GREEDY_BELOW = 1e-5  # temperatures this small divide logits into inf: treat them as greedy
_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients get a large negative number instead


# A body still arriving after this long is a client holding a connection, not an upload: 4 MiB
# (max_body_bytes' default) at 1 Mbit/s takes 34 s.
BODY_TIMEOUT_S = 60.0


async def read_body(request: Request, model: type[M]) -> M:
    _check_content_type(request.headers.get("content-type"))
    try:
        body = await asyncio.wait_for(request.body(), BODY_TIMEOUT_S)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log
        raise APIError(499, "the client closed the request before its body arrived") from None
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s: send it whole"
        ) from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise _unparsable(body, e) from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    if json.detect_encoding(body) != "utf-8" or _SURROGATE_HINT.search(body):
        _check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


class _LongNumber:
    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _unparsable(body: bytes, error: Exception) -> APIError:
    """The 400 for a body json.loads refused. An integer longer than Python reads
    (sys.int_max_str_digits, 4,300 digits; its error names that setting) is reported at its
    field; the body is parsed again for it, with such numbers as markers, only on this path."""
    most = sys.get_int_max_str_digits()
    if most:
        try:
            data = json.loads(body, parse_int=lambda t: _LongNumber(t) if len(t) > most else 0)
        except (ValueError, RecursionError) as again:
            error = again  # what else is wrong with it, the number aside
        else:
            for path, value in _values(data):
                if isinstance(value, _LongNumber) and value.digits > most:
                    return bad_request(
                        f"invalid {path or 'request'}: a number with {value.digits} digits is "
                        "larger than any this server takes: send a number in the field's range",
                        path or None,
                    )
    return bad_request(f"the request body is not valid UTF-8 JSON: {error}")


def _values(data: object) -> Iterator[tuple[str, object]]:
    """(path, value) of `data` and every value inside it, the outermost first; paths dotted as
    pydantic names fields ("messages.0.content"), a key cut to 64 characters."""
    todo: collections.deque[tuple[str, object]] = collections.deque([("", data)])
    while todo:
        path, value = todo.popleft()
        yield path, value
        if isinstance(value, dict):
            for k, v in value.items():
                k = k if len(k) <= 64 else f"{k[:64]}…"  # a path, not an echo of the key
                todo.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            todo.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value))


async def body_size(request: Request) -> int:
    """The size of a body read_body has read (starlette keeps it): what working on the
    request's text will cost, for Offload.run."""
    return len(await request.body())


def _check_content_type(value: str | None) -> None:
    """JSON, a `+json` type, or no Content-Type at all (curl -d would send a form type: pass
    -H 'Content-Type: application/json'); anything else is 415."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"Content-Type {clip(value)} is not JSON: send the body as JSON with "
            "'Content-Type: application/json'",
        )


# json.loads makes a lone surrogate (a str UTF-8 cannot encode, which tokenizers refuse) from
# an unpaired \ud800-\udfff escape, or from its raw bytes (it decodes with "surrogatepass").
# The body is searched first so that an ordinary request costs no walk over its values.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _check_unicode(data: dict) -> None:
    """400 naming a field (dotted, as pydantic names them) whose text holds a lone surrogate,
    the outermost first."""
    for path, value in _values(data):
        if isinstance(value, str):
            _no_surrogate(value, path, path)
        elif isinstance(value, dict):
            for k in value:
                _no_surrogate(k, f"a key in {path or 'the request body'}", path)


def _no_surrogate(text: str, name: str, param: str) -> None:
    if (found := _SURROGATE.search(text)) is not None:
        raise bad_request(
            f"{name} is not valid Unicode (UTF-8): it holds the lone surrogate "
            f"{found.group()!r} at character {found.start()}, which cannot be tokenized; "
            "pair each \\ud800-\\udbff escape with a \\udc00-\\udfff one, or send the text "
            "itself as UTF-8",
            param or None,
        )


def sampling_params(
    state: ServerState,
    req: SamplingFields,
    *,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    choice: int,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """SamplingParams for choice `choice` of a request, its output held to `constraint`
    (structured.py). max_tokens defaults to what the context leaves (or the server's
    default_max_tokens) and may not exceed it. A seeded request gives choice i the seed + i,
    so n choices differ yet each is reproducible."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server: drop it", "logit_bias")
    context = state.engine.context
    room = context.tokens - prompt_len
    if room < 1:
        raise bad_request(
            f"the prompt has {prompt_len} tokens but {context.context}, leaving no room to "
            f"generate: shorten the prompt{context.remedy}",
            "messages" if hasattr(req, "messages") else "prompt",
        )
    if max_tokens is None:
        max_tokens = min(state.config.default_max_tokens or room, room)
    elif max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} is more than the context leaves: the prompt has "
            f"{prompt_len} tokens and {context.context}, so at most {room}; lower max_tokens or "
            f"shorten the prompt{context.remedy}",
            "max_tokens",
        )
    bad_ids = [t for t in req.stop_token_ids or () if not 0 <= t < state.engine.vocab_size]
    if bad_ids:
        raise bad_request(
            f"stop_token_ids {clip(bad_ids[:5])} are outside the vocabulary [0, "
            f"{state.engine.vocab_size})",
            "stop_token_ids",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    seed = None if req.seed is None else (req.seed + choice) % 2**63
    try:
        return SamplingParams(
            temperature=0.0 if temperature < _GREEDY_BELOW else temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=None if constraint is None else constraint.outputs,
        )
    except ValueError as e:  # "invalid max_tokens=...: hint", from SamplingParams._check
        field = _SAMPLING_FIELD.match(str(e))
        raise bad_request(str(e), field[1] if field else None) from None


_SAMPLING_FIELD = re.compile(r"invalid (\w+)=")


def too_long(state: ServerState, chars: int, least: int, param: str) -> APIError:
    """The 400 of a prompt of `chars` characters whose length alone shows it has at least
    `least` tokens, more than the context leaves room for."""
    return bad_request(
        f"the prompt has {chars} characters, so at least {least} tokens, but the context holds "
        f"{state.engine.max_model_len}, leaving no room to generate: shorten the prompt",
        param,
    )


def validate(
    state: ServerState,
    prompt_ids: list[int],
    params: SamplingParams,
    param: str,
    constraint: Constraint | None = None,
) -> None:
    """The engine's checks as a 400: naming `param` (the prompt's field), or the field the
    constraint came from when the engine refuses the constraint (it does not compile)."""
    try:
        state.engine.validate(prompt_ids, params)
    except ValueError as e:
        refusal = constraint.refusal(e) if constraint is not None else None
        raise (refusal or bad_request(str(e), param)) from None


# -- logprobs ---------------------------------------------------------------------------------


def _lp(x: float) -> float:
    return _MIN_LOGPROB if math.isnan(x) or x < _MIN_LOGPROB else x


def _token_text(state: ServerState, token_id: int) -> str:
    return state.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely of an engine logprobs entry (it holds the sampled token plus the top n,
    so the sampled one may be an (n+1)-th)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(state: ServerState, ids: list[int], entries: list[dict[int, float]], n: int):
    """OpenAI chat: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = []
    for token_id, entry in zip(ids, entries):
        text = _token_text(state, token_id)
        top = [
            {"token": (t := _token_text(state, i)), "logprob": _lp(lp), "bytes": list(t.encode())}
            for i, lp in _top(entry, n)
        ]
        lp = entry.get(token_id, _MIN_LOGPROB)
        content.append(
            {"token": text, "logprob": _lp(lp), "bytes": list(text.encode()), "top_logprobs": top}
        )
    return content


def completion_logprobs(
    state: ServerState, ids: list[int], entries: list[dict[int, float]], n: int, offset: int
) -> dict:
    """OpenAI legacy completions: {tokens, token_logprobs, top_logprobs, text_offset}."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text = _token_text(state, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(entry.get(token_id, _MIN_LOGPROB)))
        out["top_logprobs"].append({_token_text(state, i): _lp(lp) for i, lp in _top(entry, n)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# -- transport ---------------------------------------------------------------------------------


# Characters that str.splitlines (and so httpx's iter_lines and many other clients) takes for a
# line break, which json.dumps(ensure_ascii=False) leaves raw: a token's text holding one would
# split an event in two. Inside JSON they can only sit in strings, where the escape is the same
# text.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(data: dict | str) -> str:
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class StreamEvents:
    """The chunk events of one stream, byte for byte `sse(response(state, rid, obj, choices,
    created, **extra))`: what every chunk shares (id, object, created, model, and `usage: null`
    where the stream ends with usage) is encoded once, and a lone choice whose values are
    strings, integers, None or a dict of strings (a text chunk, a delta, no logprobs) is
    written out directly. json.dumps of a whole chunk took about 6 us, of the ~32 the event loop
    spends a chunk at 64 streams on 2 cores (benchmarks/serve_overhead.py); this takes under 1."""

    def __init__(self, state: ServerState, rid: str, obj: str, created: int, usage_null: bool):
        head = json.dumps(
            {"id": rid, "object": obj, "created": created, "model": state.model_name},
            ensure_ascii=False,
        ).translate(_LINE_BREAKS)
        self._head = f'data: {head[:-1]}, "choices": '
        self._tail = ', "usage": null}\n\n' if usage_null else "}\n\n"

    def chunk(self, choices: list[dict]) -> str:
        body = _choice_json(choices[0]) if len(choices) == 1 else None
        if body is None:
            body = json.dumps(choices, ensure_ascii=False)
        else:
            body = f"[{body}]"
        return self._head + body.translate(_LINE_BREAKS) + self._tail


def _choice_json(choice: dict) -> str | None:
    """json.dumps(choice, ensure_ascii=False) for values json writes without choices of its
    own (str, int, None, a dict of str); None for anything else."""
    parts = []
    for key, value in choice.items():
        if value is None:
            text = "null"
        elif isinstance(value, str):
            text = _encode_str(value)
        elif type(value) is int:
            text = str(value)
        elif isinstance(value, dict) and all(type(v) is str for v in value.values()):
            if not all(type(k) is str for k in value):
                return None
            inner = ", ".join(f"{_encode_str(k)}: {_encode_str(v)}" for k, v in value.items())
            text = f"{{{inner}}}"
        else:
            return None
        parts.append(f"{_encode_str(key)}: {text}")
    return "{" + ", ".join(parts) + "}"


async def _wait_for_disconnect(request: Request) -> None:
    # The body is read already: the next ASGI message is the client going away.
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:  # no way to tell: never claim a disconnect that did not happen
        await asyncio.Event().wait()


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine
    requests and frees their KV) and answer 499, nginx's "client closed request"."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise APIError(499, "the client closed the request")


@dataclass
class Collected:
    """One choice of a non-streaming request, run to its end."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None


async def collect(state: ServerState, requests: list) -> list[Collected]:
    """Run `requests` (engine.generate's (id, prompt ids, params) tuples) to the end; one
    Collected per request, in order. A dead engine is a 503."""
    from outrider.server.async_engine import EngineDeadError

    n = len(requests)
    texts, ids, lps = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    try:
        async with contextlib.aclosing(state.engine.generate(requests)) as outputs:
            async for i, out in outputs:
                texts[i].append(out.text)
                ids[i].extend(out.token_ids)
                lps[i].extend(out.logprobs or ())
                if out.finished:
                    reasons[i] = out.finish_reason
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    return [Collected("".join(texts[i]), ids[i], lps[i], reasons[i]) for i in range(n)]


def response(
    state: ServerState, rid: str, obj: str, choices: list[dict], created: int | None = None, **extra
) -> dict:
    """The OpenAI envelope of a response or stream chunk, for both endpoints: id, object,
    created (now unless given: a stream keeps its first chunk's), model, choices, then extra."""
    created = int(time.time()) if created is None else created
    return {"id": rid, "object": obj, "created": created, "model": state.model_name,
            "choices": choices, **extra}  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
