"""vLLM's utility endpoints: POST /tokenize (a prompt, or messages through the chat template,
exactly as a completion request would see them), POST /detokenize, GET /version.

Neither refuses a text longer than the context (as vLLM's do not): a 4 MB prompt is tokenized
whole, in the offload pool (offload.py), and its answer written there too."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from outrider import __version__
from outrider.server.errors import bad_request
from outrider.server.limits import check_tokenize
from outrider.server.offload import json_array
from outrider.server.protocol import DetokenizeRequest, TokenizeRequest
from outrider.server.serving import body_size, read_body
from outrider.server.serving_chat import render, template_message
from outrider.server.state import ServerState


async def tokenize(state: ServerState, request: Request) -> Response:
    req = await read_body(request, TokenizeRequest)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt or messages (one of them) to tokenize", "prompt")
    check_tokenize(state.config, req)
    body = await state.offload.run(await body_size(request), _tokenize_answer, state, req)
    return Response(body, media_type="application/json")


def _tokenize_answer(state: ServerState, req: TokenizeRequest) -> bytes:
    ids = _tokenize(state, req)
    fields = [f'"count":{len(ids)}', f'"max_model_len":{state.engine.max_model_len}']
    fields.append(f'"tokens":{json_array(ids)}')
    if req.return_token_strs:
        texts = state.engine.tokenizer.token_texts
        fields.append(f'"token_strs":{json_array([texts[i] for i in ids])}')
    return ("{" + ",".join(fields) + "}").encode()


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:  # as a chat completion sees them
        messages = [template_message(m, i) for i, m in enumerate(req.messages)]
        return render(state, req, messages, None, bool(req.add_special_tokens))
    special = True if req.add_special_tokens is None else req.add_special_tokens
    try:
        return state.engine.tokenizer.encode(req.prompt, add_special_tokens=special)
    except (ValueError, TypeError, UnicodeError) as e:
        raise bad_request(f"could not tokenize the prompt: {e}", "prompt") from None


async def detokenize(state: ServerState, request: Request) -> JSONResponse:
    req = await read_body(request, DetokenizeRequest)
    state.check_model(req.model)
    text = await state.offload.run(await body_size(request), _detokenize, state, req.tokens)
    return JSONResponse({"prompt": text})


def _detokenize(state: ServerState, tokens: list[int]) -> str:
    vocab = state.engine.tokenizer.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    return state.engine.tokenizer.decode(tokens, False)


def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
