"""Incremental detokenization, stop strings and finish reasons (CPU only, no tensors).

The engine, per request and step:
    req.output_token_ids += new_ids            (one at a time, or via count_until_stop)
    delta = detok.update(new_ids)              # new stable text; stop strings checked here
    reason = check_stop(req, max_model_len) or (FinishReason.STOP if detok.stop_hit else None)
    if reason: delta += detok.flush()          # release what was held back
Invariant: the deltas returned by update() and flush() concatenate to `text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from outrider.core import FinishReason, Request, SamplingParams
from outrider.engine.stop_strings import StopStrings

# Prompt tokens decoded ahead of the output so the first output token is read in context
# (SentencePiece drops a word's leading space when it starts the decoded text). vLLM uses 5.
_PROMPT_CONTEXT_TOKENS = 5
# What a byte-level or SentencePiece decoder prints for bytes that do not yet form a character.
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output ids into text as they arrive, cutting at stop strings.

    Decoding uses vLLM's prefix_offset/read_offset window: each update decodes
    ids[prefix_offset:read_offset] and ids[prefix_offset:] and emits the difference, so a step
    costs O(new tokens), not O(output). Text that ends in an incomplete UTF-8 character (U+FFFD)
    is held back until the character completes. When stop strings would be cut from the output,
    a tail of `text` that could still grow into one is held back from the deltas and released
    once it cannot (or on flush()).

    Attributes: text (the output so far, cut at a stop string unless
    params.include_stop_str_in_output), stop_hit, stop_str (the matched stop string or None).
    Create it before the request has output tokens.
    """

    def __init__(self, tokenizer: Tokenizer, request: Request) -> None:
        self._tokenizer = tokenizer
        self._params: SamplingParams = request.params
        context = list(request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # prompt context + output ids so far
        self._prefix_offset = 0
        self._read_offset = len(context)  # ids before this are already in `text`
        self.text = ""
        self.stop_hit = False
        self.stop_str: str | None = None
        self._emitted = 0  # characters of `text` already returned as deltas
        self._stops = StopStrings(self._params.stop) if self._params.stop else None
        # With the stop string kept in the output, streaming its first characters early is
        # harmless: the final text contains them too. Only a cut needs the hold-back.
        self._hold = not self._params.include_stop_str_in_output

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._params.skip_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Adds output ids; returns the text that became stable, minus any held-back tail.
        After a stop string was hit it returns "" and ignores further ids."""
        if self.stop_hit or not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Nothing printable yet (e.g. a skipped special token), or a character still open.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Call once the request finished: returns everything not yet streamed, including a
        trailing incomplete character (as U+FFFD, as a full decode would print it)."""
        out = ""
        if not self.stop_hit and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            out = self._append(new_text[len(prefix_text) :])
        out += self.text[self._emitted :]
        self._emitted = len(self.text)
        return out

    def _append(self, delta: str) -> str:
        self.text += delta
        # The earliest-starting match that ends in `delta` (stop_strings.py: the text is fed
        # once, so a step costs its new characters, not the number of stop strings).
        hit = self._stops.feed(delta) if self._stops is not None else None
        if hit is not None:
            start, stop = hit
            keep = start + len(stop) if self._params.include_stop_str_in_output else start
            # start >= self._emitted: the part of a new match lying in old text is a proper
            # prefix of the stop string at the end of that text, which was held back.
            self.text = self.text[:keep]
            self.stop_hit, self.stop_str = True, stop
            stable = len(self.text)
        else:
            # The longest tail of `text` that is a proper prefix of a stop string.
            held = self._stops.pending if self._stops is not None and self._hold else 0
            stable = len(self.text) - held
        out = self.text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        return out


def _stop_reason(
    req: Request, token_id: int, num_output: int, num_tokens: int, max_model_len: int
) -> FinishReason | None:
    """Why the request stops right after `token_id` became output token number num_output
    (num_tokens counting the prompt). A stop token beats a length limit reached with it."""
    p = req.params
    # The sampler masks EOS and stop ids while the output is shorter than min_tokens; this gate
    # covers tokens that came another way (forced, or drafted and accepted).
    if num_output >= p.min_tokens:
        if not p.ignore_eos and token_id in req.eos_token_ids:
            return FinishReason.STOP
        if token_id in p.stop_token_ids:
            return FinishReason.STOP
    if p.max_tokens is not None and num_output >= p.max_tokens:
        return FinishReason.LENGTH
    if num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def check_stop(req: Request, max_model_len: int) -> FinishReason | None:
    """Token-level stop after the last output token: EOS (unless ignore_eos) or a stop token id,
    both only once len(output) >= min_tokens -> STOP; max_tokens reached or the sequence at
    max_model_len -> LENGTH. Stop strings are the detokenizer's (stop_hit). Pure: the caller
    sets the request's status and finish_reason."""
    out = req.output_token_ids
    if not out:
        return None
    return _stop_reason(req, out[-1], len(out), req.num_tokens, max_model_len)


def count_until_stop(
    req: Request, new_token_ids: Sequence[int], max_model_len: int
) -> tuple[int, FinishReason | None]:
    """For several tokens about to be appended (accepted drafts): how many to keep, and the
    finish reason if one of them ends the request. Same rules as check_stop, token by token,
    without touching the request. ([7, EOS, 9] with EOS allowed -> (2, STOP).)"""
    num_output, num_tokens = len(req.output_token_ids), req.num_tokens
    for j, token_id in enumerate(new_token_ids, start=1):
        reason = _stop_reason(req, token_id, num_output + j, num_tokens + j, max_model_len)
        if reason is not None:
            return j, reason
    return len(new_token_ids), None
