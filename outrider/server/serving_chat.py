"""POST /v1/chat/completions: messages -> chat template (with tools) -> engine -> message,
reasoning_content and tool_calls, whole or as SSE chunks. A structured output or a forced tool
call (structured.py) holds the output to a grammar."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from outrider.loaders.tokenizer import TextTooLong
from outrider.server.async_engine import EngineDeadError
from outrider.server.choice_text import ChoiceText
from outrider.server.errors import APIError, bad_request, clip
from outrider.server.limits import check_chat
from outrider.server.parsers.base import ReasoningParser, ToolCall
from outrider.server.protocol import ChatCompletionRequest, ChatMessage, new_id
from outrider.server.serving import (
    SSE_DONE,
    StreamEvents,
    body_size,
    chat_logprobs,
    collect,
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
from outrider.server.structured import request_constraint, tool_call_constraint


async def create_chat_completion(state: ServerState, request: Request):
    req = await read_body(request, ChatCompletionRequest)
    state.check_admission()
    state.check_model(req.model)
    check_chat(state.config, req)
    tools = _rendered_tools(req)
    constraint = request_constraint(req, tool_call_constraint(req, state.tool_parser))
    messages = [template_message(m, i) for i, m in enumerate(req.messages)]
    size = await body_size(request)
    limit = state.engine.max_model_len - 1  # a prompt of max_model_len tokens leaves no room
    prompt_ids = await state.offload.run(size, render, state, req, messages, tools, False, limit)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    rid = new_id("chatcmpl")
    requests = []
    for i in range(req.n):
        params = sampling_params(
            state,
            req,
            prompt_len=len(prompt_ids),
            max_tokens=max_tokens,
            logprobs=top_n,
            choice=i,
            constraint=constraint,
        )
        if state.tool_parser is not None and state.tool_parser.needs_special_tokens and tools:
            params = _keep_special_tokens(params)
        validate(state, prompt_ids, params, "messages", constraint)
        requests.append((f"{rid}-{i}", prompt_ids, params))
    parser = state.tool_parser if tools else None
    # A constrained output has no free text to reason in: all of it is the answer (a template
    # that opens <think> itself would otherwise make it all reasoning).
    reasoning = state.reasoning_parser if constraint is None else None
    if req.stream:
        return StreamingResponse(
            _stream(state, req, rid, requests, parser, reasoning, top_n),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await unless_disconnected(
        request, _complete(state, req, rid, requests, parser, reasoning, top_n)
    )
    return JSONResponse(body)


def _rendered_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the template renders: none when absent or tool_choice is "none"."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A message as HF chat templates expect it: text content, tool-call arguments as dicts."""
    if isinstance(m.content, list):
        kinds = {p.type for p in m.content} - {"text"}
        if kinds:
            raise bad_request(
                f"messages[{index}] has content parts of type {clip(sorted(kinds))}: this server "
                "reads text parts only",
                f"messages.{index}.content",
            )
        content = "".join(p.text or "" for p in m.content)
    else:
        content = m.content or ""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = content
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    return out


def _arguments(arguments: str | dict) -> dict | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def render(
    state: ServerState,
    req,
    messages,
    tools,
    add_special_tokens: bool = False,
    max_tokens: int | None = None,
) -> list[int]:
    """Template and tokenize (Offload.run: inline for a small body, in a thread for a large
    one). `req` gives add_generation_prompt and chat_template_kwargs (a chat or a /tokenize
    request); a rendered text whose length shows it exceeds max_tokens is refused untokenized."""
    try:
        # Special-token text in a client's messages stays text: it cannot open a system turn.
        # The template writes BOS itself when the model wants one.
        return state.chat_tokenizer.encode_chat(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=tools,
            add_special_tokens=add_special_tokens,
            max_tokens=max_tokens,
            **(req.chat_template_kwargs or {}),
        )
    except TextTooLong as e:
        raise too_long(state, e.chars, e.least, "messages") from None
    except (ValueError, TypeError, UnicodeError) as e:
        raise bad_request(
            f"the messages could not be rendered or tokenized: {e}", "messages"
        ) from None


def _keep_special_tokens(params):
    return dataclasses.replace(params, skip_special_tokens=False)


def _strip_eos_text(state: ServerState, text: str) -> str:
    for token_id in state.engine.tokenizer.eos_token_ids:
        eos = state.engine.tokenizer.decode([token_id], skip_special_tokens=False)
        if eos and text.endswith(eos):
            return text[: -len(eos)]
    return text


def _tool_calls_json(calls: list[ToolCall], with_index: bool = False) -> list[dict]:
    return [
        {
            **({"index": i} if with_index else {}),
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


async def _complete(state, req, rid, requests, parser, reasoning, top_n) -> dict:
    done = await collect(state, requests)
    choices = []
    for i, c in enumerate(done):
        text = c.text
        if parser is not None and parser.needs_special_tokens:
            text = _strip_eos_text(state, text)
        split = ChoiceText(reasoning, parser)
        r1, c1 = split.feed(text)
        r2, c2, calls = split.finish()
        message: dict[str, Any] = {"role": "assistant", "content": (c1 + c2) or None}
        if state.reasoning_parser is not None:
            message["reasoning_content"] = (r1 + r2) or None
        if calls:
            message["tool_calls"] = _tool_calls_json(calls)
        elif message["content"] is None:
            message["content"] = ""
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": chat_logprobs(state, c.token_ids, c.logprobs, top_n)}
                if top_n is not None
                else None,
                "finish_reason": "tool_calls" if calls else c.finish_reason,
            }
        )
    prompt_len = len(requests[0][1])
    totals = usage(prompt_len, sum(len(c.token_ids) for c in done))
    return response(state, rid, "chat.completion", choices, usage=totals)


async def _stream(state, req, rid, requests, parser, reasoning: ReasoningParser | None, top_n):
    created, n = int(time.time()), len(requests)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    events = StreamEvents(state, rid, "chat.completion.chunk", created, include_usage)

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return events.chunk([choice])

    splits = [ChoiceText(reasoning, parser) for _ in range(n)]
    completion_tokens = 0
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async with contextlib.aclosing(state.engine.generate(requests)) as outputs:
            async for i, out in outputs:
                completion_tokens += len(out.token_ids)
                text = out.text
                if out.finished and parser is not None and parser.needs_special_tokens:
                    text = _strip_eos_text(state, text)
                reasoning, content = splits[i].feed(text)
                delta = _delta(reasoning, content)
                logprobs = None
                if top_n is not None and out.token_ids:
                    logprobs = {
                        "content": chat_logprobs(state, out.token_ids, out.logprobs or [], top_n)
                    }
                if not out.finished:
                    if delta or logprobs:
                        yield chunk(i, delta, logprobs=logprobs)
                    continue
                r, c, calls = splits[i].finish()
                delta = _delta(reasoning + r, content + c)
                if calls:
                    delta["tool_calls"] = _tool_calls_json(calls, with_index=True)
                reason = "tool_calls" if calls else out.finish_reason
                yield chunk(i, delta, reason, logprobs)
    except EngineDeadError as e:
        yield sse(APIError(503, str(e)).to_dict())
    if include_usage:
        totals = usage(len(requests[0][1]), completion_tokens)
        yield sse(response(state, rid, "chat.completion.chunk", [], created, usage=totals))
    yield SSE_DONE


def _delta(reasoning: str, content: str) -> dict:
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta
