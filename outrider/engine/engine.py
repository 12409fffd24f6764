"""EngineCore.step(): schedule -> execute -> postprocess. CPU bookkeeping lives here and in the
scheduler; the model runner owns every tensor."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from outrider import env
from outrider.config import EngineConfig
from outrider.core import FinishReason, Request, RequestOutput, RequestStatus, SamplingParams
from outrider.engine.block_manager import BlockManager
from outrider.engine.detokenizer import IncrementalDetokenizer, check_stop
from outrider.engine.scheduler import Scheduler
from outrider.executor.model_runner import ModelRunner
from outrider.executor.sampler import make_generator
from outrider.loaders.checkpoint import Checkpoint, open_checkpoint

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    prompt: str | None


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        if env.num_threads() > 0:
            torch.set_num_threads(env.num_threads())
        self.config = config
        self.checkpoint = checkpoint or open_checkpoint(config.model.model or env.default_model())
        self.tokenizer = self.checkpoint.tokenizer
        self.runner = ModelRunner(config, self.checkpoint)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.checkpoint.config.eos_token_ids
        )
        self.vocab_size = self.checkpoint.config.vocab_size
        self._pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        self._tracked: dict[str, _Tracked] = {}

    # -- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem; the engine's state is untouched either way."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token or character")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context holds {self.max_model_len}, which must "
                f"include at least one generated token: shorten the prompt or raise max_model_len"
            )
        pool_tokens = self._pool_tokens
        if n + 1 > pool_tokens:
            raise ValueError(
                f"the prompt has {n} tokens but the whole KV pool holds {pool_tokens}: give the "
                f"cache more memory (cpu_kv_bytes / gpu_memory_utilization / num_blocks)"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> Request:
        self.validate(prompt_token_ids, params)
        req = Request(
            prompt_token_ids=list(prompt_token_ids), params=params, eos_token_ids=self.eos_token_ids
        )
        if request_id is not None:
            if request_id in self._tracked:
                raise ValueError(f"request id {request_id!r} is already in use: pass a unique id")
            req.request_id = request_id
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.runner.device)
        self._tracked[req.request_id] = _Tracked(
            req, IncrementalDetokenizer(self.tokenizer, req), prompt
        )
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._tracked.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta (new text and token ids) per request that advanced."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        output = self.runner.run(batch)
        self.scheduler.postprocess(batch, output)
        deltas = []
        for rid, new_ids in zip(output.request_ids, output.token_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue  # aborted while the step ran
            req = tracked.request
            text = tracked.detokenizer.update(new_ids)
            reason = (
                FinishReason.STOP
                if tracked.detokenizer.stop_hit
                else check_stop(req, self.max_model_len)
            )
            if reason is None and req.num_tokens >= self._pool_tokens:
                reason = FinishReason.LENGTH  # the next token would not fit even in an empty pool
            if reason is not None:
                self.scheduler.finish(req, reason)
                text += tracked.detokenizer.flush()  # text held back as a possible stop string
                del self._tracked[rid]
            deltas.append(self._output(tracked, text, new_ids))
        return deltas

    def _output(self, tracked: _Tracked, delta_text: str, new_ids: list[int]) -> RequestOutput:
        req = tracked.request
        finished = req.status == RequestStatus.FINISHED
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=delta_text,
            token_ids=list(new_ids),
            finished=finished,
            finish_reason=str(req.finish_reason) if finished else None,
            metrics=request_metrics(req) if finished else {},
            logprobs=req.output_logprobs[-len(new_ids) :]
            if req.params.logprobs is not None
            else None,
        )


def request_metrics(req: Request) -> dict[str, float | int | None]:
    m = req.metrics
    n = len(req.output_token_ids)
    start = m.first_scheduled_time or m.arrival_time
    end = m.finished_time or time.perf_counter()
    decode_time = end - (m.first_token_time or end)
    return {
        "num_prompt_tokens": m.num_prompt_tokens,
        "num_generated_tokens": n,
        "num_cached_tokens": m.num_cached_tokens,
        "num_preemptions": m.num_preemptions,
        "time_to_first_token_s": None
        if m.first_token_time is None
        else m.first_token_time - m.arrival_time,
        "e2e_latency_s": end - m.arrival_time,
        "tokens_per_s": n / (end - start) if end > start else None,
        "decode_tokens_per_s": (n - 1) / decode_time if n > 1 and decode_time > 0 else None,
    }
