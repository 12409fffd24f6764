"""What one request may hold: the context an engine serves (the model's or the configured limit,
within the KV pool) and the check every request passes before it is queued."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.config import EngineConfig
    from outrider.core import SamplingParams
    from outrider.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextLimit:
    """The context one request may use (tokens, prompt and output), and what sets it, as
    messages name it: `context` "the context is 1024 tokens, all the KV cache holds (...)",
    `remedy` what would raise it (", or ..."; empty when only a shorter prompt helps)."""

    tokens: int
    context: str
    remedy: str


def context_limit(runner: ModelRunner, config: EngineConfig) -> ContextLimit:
    """The context one request may use: the configured (or the model's) limit, capped by what
    the whole KV pool holds, so an admitted request always runs to its end (alone, by
    preempting the others) instead of being cut short. Only the engine's limit drops: the
    runner keeps its own max_model_len, which sizes its rotary table and graph block tables and
    so covers this one."""
    limit = runner.max_model_len
    cache = config.cache
    pool = runner.num_blocks * cache.block_size
    held = f"{runner.num_blocks} blocks of {cache.block_size} tokens"
    if limit <= pool:
        if config.model.max_model_len is not None:
            return ContextLimit(
                limit, f"the context is {limit} tokens (max_model_len, as configured)",
                ", or raise max_model_len",
            )  # fmt: skip
        return ContextLimit(limit, f"the context is {limit} tokens (the model's max_model_len)", "")
    if config.model.max_model_len is not None:
        raise ValueError(
            f"max_model_len={limit} does not fit the KV cache, which holds {pool} tokens "
            f"({held}): give the cache more memory (gpu_memory_utilization / cpu_kv_bytes "
            f"/ num_blocks) or use max_model_len <= {pool}"
        )
    log.warning(
        "max_model_len lowered from the model's %d to %d tokens, all the KV cache holds "
        "(%s): give the cache more memory (gpu_memory_utilization / cpu_kv_bytes / "
        "num_blocks) for the full context",
        limit, pool, held,
    )  # fmt: skip
    return ContextLimit(
        pool,
        f"the context is {pool} tokens, all the KV cache holds ({held}; the model's "
        f"max_model_len is {limit})",
        ", or give the KV cache more memory (gpu_memory_utilization / cpu_kv_bytes / num_blocks)",
    )


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, context: ContextLimit
) -> None:
    """Raise ValueError naming what is wrong with a request and what to do instead."""
    if params.n != 1:
        raise ValueError(
            f"n={params.n}: an engine request is one completion; LLM.generate/chat run n "
            "(one request each), or add n requests"
        )
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token or character")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    # The context is within the KV pool (context_limit): what passes here fits.
    if n >= context.tokens:
        raise ValueError(
            f"the prompt has {n} tokens but {context.context}, which must include at least one "
            f"generated token: shorten the prompt{context.remedy}"
        )
    # prompt + max_tokens past the context: the server refuses it (400, serving.py, as vLLM's
    # does); here, as in vLLM's offline API, generation stops at the context's end with
    # finish_reason "length" (datagen's long conversations count on it).
