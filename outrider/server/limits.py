"""What one request may ask of the server (ServerConfig's max_* settings), checked right after
the body is read, before any template, tokenizer or engine work: the work a request causes
grows with each of these, some of it on the engine thread every step (stop strings), so each is
bounded. A refusal is a 400 naming the field, the value given, the limit and the flag that
raises it.

Token-id prompts need no bound here: the engine refuses one longer than the context, and a
list's size is bounded by max_body_bytes.
"""

from __future__ import annotations

import json

from outrider.server.config import ServerConfig
from outrider.server.errors import APIError, bad_request, clip
from outrider.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    TokenizeRequest,
)

_MOST_LOGPROBS = 20  # what SamplingParams computes (ServerConfig refuses a higher max_logprobs)


def _refusal(said: str, limit: str, name: str, fix: str, param: str) -> APIError:
    """'<said>: more than this server allows (<limit>); <fix>, or raise it with --flag'."""
    flag = "--" + name.replace("_", "-")
    return bad_request(
        f"{said}: more than this server allows ({limit}); {fix}, or raise it with {flag} "
        f"({name} in the server config)",
        param,
    )


def _check(
    value: int, config: ServerConfig, name: str, said: str, fix: str, param: str, unit: str = ""
) -> None:
    limit = getattr(config, name)
    if value > limit:
        raise _refusal(said, f"{limit}{unit}", name, fix, param)


def check_completion(config: ServerConfig, req: CompletionRequest) -> None:
    _check_sampling(config, req, req.logprobs, "logprobs")
    fix = "shorten it, or send token ids"
    if isinstance(req.prompt, str):
        _check_prompt_chars(config, len(req.prompt), "the prompt has", fix, "prompt")
    elif req.prompt and all(isinstance(p, str) for p in req.prompt):
        chars = sum(len(p) for p in req.prompt)
        said = f"the {len(req.prompt)} prompts have"
        _check_prompt_chars(config, chars, said, "split the request", "prompt")


def check_chat(config: ServerConfig, req: ChatCompletionRequest) -> None:
    _check_sampling(config, req, req.top_logprobs, "top_logprobs")
    _check_messages(config, req.messages)
    if req.tools:
        _check(len(req.tools), config, "max_tools", f"{len(req.tools)} tools", "send fewer",
               "tools")  # fmt: skip
        # What the template renders into the prompt (and a forced call compiles into a grammar).
        chars = len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools]))
        _check(chars, config, "max_tools_chars", f"the tools' JSON has {chars} characters",
               "send fewer or smaller tools", "tools", " characters")  # fmt: skip


def check_tokenize(config: ServerConfig, req: TokenizeRequest) -> None:
    if req.prompt is not None:
        _check_prompt_chars(config, len(req.prompt), "the prompt has", "shorten it", "prompt")
    if req.messages is not None:
        _check_messages(config, req.messages)


def _check_sampling(
    config: ServerConfig, req: SamplingFields, top_logprobs: int | None, field: str
) -> None:
    _check(req.n, config, "max_n", f"n={req.n}", "ask for fewer choices", "n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _check(len(stops), config, "max_stop_strings", f"{len(stops)} stop strings", "send fewer",
           "stop")  # fmt: skip
    for i, stop in enumerate(stops):
        shown = clip(stop[:40]) + ("…" if len(stop) > 40 else "")
        _check(
            len(stop), config, "max_stop_string_chars",
            f"the stop string {shown} has {len(stop)} characters", "shorten it",
            "stop" if isinstance(req.stop, str) else f"stop.{i}", " characters",
        )  # fmt: skip
    ids = req.stop_token_ids or []
    _check(len(ids), config, "max_stop_token_ids", f"{len(ids)} stop_token_ids", "send fewer",
           "stop_token_ids")  # fmt: skip
    if top_logprobs is not None and top_logprobs > config.max_logprobs:
        if config.max_logprobs == _MOST_LOGPROBS:  # no flag raises it further
            raise bad_request(
                f"{field}={top_logprobs}: more than this server computes ({_MOST_LOGPROBS} top "
                f"logprobs per token); ask for {_MOST_LOGPROBS} or fewer",
                field,
            )
        _check(top_logprobs, config, "max_logprobs", f"{field}={top_logprobs}",
               f"ask for {config.max_logprobs} or fewer", field)  # fmt: skip


def _check_messages(config: ServerConfig, messages: list[ChatMessage]) -> None:
    chars = sum(_text_chars(m) for m in messages)
    _check_prompt_chars(config, chars, "the messages have", "shorten them", "messages")


def _check_prompt_chars(config: ServerConfig, chars: int, said: str, fix: str, param: str) -> None:
    _check(chars, config, "max_prompt_chars", f"{said} {chars} characters of text", fix, param,
           " characters")  # fmt: skip


def _text_chars(m: ChatMessage) -> int:
    """Characters of a message's text: every field the template may render."""
    content = m.content if isinstance(m.content, str) else ""
    parts = sum(len(p.text or "") for p in m.content) if isinstance(m.content, list) else 0
    chars = len(content) + parts
    for text in (m.name, m.reasoning_content, m.tool_call_id):
        chars += len(text or "")
    for call in m.tool_calls or ():
        args = call.function.arguments
        chars += len(call.function.name) + (
            len(args) if isinstance(args, str) else len(json.dumps(args))
        )
    return chars
