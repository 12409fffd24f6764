"""A request the engine is serving, from the caller's side: its detokenizer and prompt text,
the text and ids each step adds, and the RequestOutput (with metrics once finished) that step
hands back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from outrider.core import Request, RequestOutput, RequestStatus
from outrider.engine.detokenizer import IncrementalDetokenizer
from outrider.speculative.stats import accept_length


@dataclass
class TrackedRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    prompt: str | None
    # Output tokens its grammar forced before any step (EngineCore.add_request): they lead
    # the first step's delta.
    pending: list[int] = field(default_factory=list)

    def detokenize(self, new_ids: list[int]) -> tuple[str, list[int]]:
        """Stream new ids through the detokenizer one at a time, so a stop string inside a run
        of accepted drafts ends the output exactly where plain decoding would have."""
        req, detok = self.request, self.detokenizer
        if not req.params.detokenize:
            return "", new_ids
        if len(new_ids) == 1:
            return detok.update(new_ids), new_ids
        text = []
        for j, token in enumerate(new_ids):
            text.append(detok.update([token]))
            if detok.stop_hit:
                extra = len(new_ids) - (j + 1)
                if extra:
                    del req.output_token_ids[-extra:]
                    if req.params.logprobs is not None:
                        del req.output_logprobs[-extra:]
                return "".join(text), new_ids[: j + 1]
        return "".join(text), new_ids

    def output(self, delta_text: str, new_ids: list[int]) -> RequestOutput:
        req = self.request
        finished = req.status == RequestStatus.FINISHED
        return RequestOutput(
            request_id=req.request_id,
            prompt=self.prompt,
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
        "accept_length": accept_length(m.num_accepted_tokens, m.num_verify_steps),
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "num_verify_steps": m.num_verify_steps,
        "accepted_per_position": list(m.accepted_per_position),
        "steps_by_k": dict(sorted(m.steps_by_k.items())),
    }
