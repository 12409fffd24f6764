"""POST /v1/completions: prompt(s) as text or token ids -> engine -> text choices, whole or as
SSE chunks, held to a structured output when one is asked for (structured.py). Choice index =
prompt index * n + i, as OpenAI numbers them."""

from __future__ import annotations

import contextlib
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from outrider.server.async_engine import EngineDeadError
from outrider.server.errors import APIError, bad_request
from outrider.server.limits import check_completion
from outrider.server.protocol import CompletionRequest, new_id
from outrider.server.serving import (
    SSE_DONE,
    StreamEvents,
    body_size,
    collect,
    completion_logprobs,
    read_body,
    response,
    sampling_params,
    sse,
    too_long,
    unless_disconnected,
    usage,
    validate,
)
from outrider.server.state import ServerState
from outrider.server.structured import request_constraint

_MAX_PROMPTS = 64  # prompts in one request: a batch beyond this belongs in several requests


async def create_completion(state: ServerState, request: Request):
    req = await read_body(request, CompletionRequest)
    state.check_admission()
    state.check_model(req.model)
    check_completion(state.config, req)
    if req.suffix:
        raise bad_request("suffix is not supported by this server: drop it", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} must equal n={req.n} here", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: use one or the other", "echo")
    constraint = request_constraint(req)
    prompts = _prompt_list(req.prompt)
    if len(prompts) * req.n > max(_MAX_PROMPTS, state.config.max_n):
        raise bad_request(
            f"{len(prompts)} prompts x n={req.n} choices is more than this server runs in one "
            f"request ({max(_MAX_PROMPTS, state.config.max_n)}): split the request",
            "prompt",
        )
    _check_lengths(state, prompts)
    encoded = await state.offload.run(await body_size(request), _encode_all, state, prompts)
    rid = new_id("cmpl")
    requests, echoes = [], []
    for p, ids in enumerate(encoded):
        for i in range(req.n):
            params = sampling_params(
                state,
                req,
                prompt_len=len(ids),
                max_tokens=req.max_tokens,
                logprobs=req.logprobs,
                choice=i,
                constraint=constraint,
            )
            validate(state, ids, params, "prompt", constraint)
            requests.append((f"{rid}-{p * req.n + i}", ids, params))
            echoes.append(_echo_text(state, prompts[p], ids) if req.echo else "")
    prompt_tokens = sum(len(ids) for ids in encoded)
    if req.stream:
        return StreamingResponse(
            _stream(state, req, rid, requests, echoes, prompt_tokens),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await unless_disconnected(
        request, _complete(state, req, rid, requests, echoes, prompt_tokens)
    )
    return JSONResponse(body)


def _prompt_list(prompt) -> list[str | list[int]]:
    """str | [str] | [int] | [[int]] -> one entry per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is an empty list: give a string or token ids", "prompt")
    if isinstance(prompt[0], int):  # the request's validation made every entry one kind
        return [list(prompt)]
    return list(prompt)


def _check_lengths(state: ServerState, prompts: list[str | list[int]]) -> None:
    """Refuse a text its length shows cannot leave room in the context, before it waits to be
    tokenized (a 4 MB prompt would take seconds): at most a few scans of it."""
    for p in prompts:
        if isinstance(p, str):
            least = state.engine.tokenizer.least_tokens(p)
            if least >= state.engine.max_model_len:
                raise too_long(state, len(p), least, "prompt")


def _encode_all(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            try:
                out.append(state.engine.tokenizer.encode(p))
            except (ValueError, TypeError, UnicodeError) as e:
                raise bad_request(f"the prompt could not be tokenized: {e}", "prompt") from None
        else:
            out.append(list(p))
    return out


def _echo_text(state: ServerState, prompt: str | list[int], ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)


def _choice_logprobs(state, req, ids, lps, offset):
    if req.logprobs is None:
        return None
    return completion_logprobs(state, ids, lps, req.logprobs, offset)


async def _complete(state, req, rid, requests, echoes, prompt_tokens) -> dict:
    done = await collect(state, requests)
    choices = [
        {
            "index": i,
            "text": echoes[i] + c.text,
            "logprobs": _choice_logprobs(state, req, c.token_ids, c.logprobs, 0),
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(done)
    ]
    totals = usage(prompt_tokens, sum(len(c.token_ids) for c in done))
    return response(state, rid, "text_completion", choices, usage=totals)


async def _stream(state, req, rid, requests, echoes, prompt_tokens):
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    offsets = [0] * len(requests)
    completion = 0
    events = StreamEvents(state, rid, "text_completion", created, include_usage)

    def chunk(choices: list[dict], totals: dict | None = None) -> str:
        if totals is None:
            return events.chunk(choices)
        return sse(response(state, rid, "text_completion", choices, created, usage=totals))

    for i, echo in enumerate(echoes):
        if echo:
            offsets[i] = len(echo)
            yield chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
    try:
        async with contextlib.aclosing(state.engine.generate(requests)) as outputs:
            async for i, out in outputs:
                completion += len(out.token_ids)
                if not out.text and not out.finished and not out.token_ids:
                    continue
                logprobs = _choice_logprobs(state, req, out.token_ids, out.logprobs, offsets[i])
                offsets[i] += len(out.text)
                choice = {
                    "index": i,
                    "text": out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
                yield chunk([choice])
    except EngineDeadError as e:
        yield sse(APIError(503, str(e)).to_dict())
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion))
    yield SSE_DONE
