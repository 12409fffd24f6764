"""vLLM's utility endpoints: POST /tokenize (a prompt, or messages through the chat template,
exactly as a completion request would see them), POST /detokenize, GET /version."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from outrider import __version__
from outrider.server.errors import bad_request
from outrider.server.limits import check_tokenize
from outrider.server.protocol import DetokenizeRequest, TokenizeRequest
from outrider.server.serving import read_body
from outrider.server.serving_chat import render, template_message
from outrider.server.state import ServerState


async def tokenize(state: ServerState, request: Request) -> JSONResponse:
    req = await read_body(request, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt or messages (one of them) to tokenize", "prompt")
    check_tokenize(state.config, req)
    ids = await asyncio.to_thread(_tokenize, state, req)
    body = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [state.engine.tokenizer.decode([i], False) for i in ids]
    return JSONResponse(body)


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:  # as a chat completion sees them
        messages = [template_message(m, i) for i, m in enumerate(req.messages)]
        return list(render(state, req, messages, None, bool(req.add_special_tokens)))
    special = True if req.add_special_tokens is None else req.add_special_tokens
    try:
        return list(state.engine.tokenizer.encode(req.prompt, add_special_tokens=special))
    except (ValueError, TypeError, UnicodeError) as e:
        raise bad_request(f"could not tokenize the prompt: {e}", "prompt") from None


async def detokenize(state: ServerState, request: Request) -> JSONResponse:
    req = await read_body(request, DetokenizeRequest)
    state.check_model(req.model)
    vocab = state.engine.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    text = await asyncio.to_thread(state.engine.tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})


def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
