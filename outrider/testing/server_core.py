"""StandInCore: the EngineCore surface the server reads (AsyncEngine, ServerState, the routes)
over no model, so that the server's own path can be tested (tests/unit/test_server_*.py) and
measured (benchmarks/serve_overhead.py) alone."""

from __future__ import annotations

import time
from types import SimpleNamespace

from outrider.core import RequestOutput
from outrider.engine.limits import ContextLimit


class StandInTokenizer:
    """What the server asks of a tokenizer with no model behind it (picklable: an engine process
    sends its core's tokenizer to the server)."""

    bos_token_id = 1

    def with_chat_template(self, limits, template, origin) -> StandInTokenizer:
        return self


class _Counts:
    """The scheduler's counters the server reads: the running requests, live."""

    num_waiting = 0
    num_preemptions = 0

    def __init__(self, core: StandInCore) -> None:
        self._core = core

    @property
    def num_running(self) -> int:
        return len(self._core.live)


class StandInCore:
    """Each running request gets one token a step (text "t<n>", id 7) and finishes after
    `tokens`. A step first sleeps `step_ms` (a device's step: the interpreter free), then spends
    `engine_us` of Python a running request (an engine's bookkeeping: the interpreter held).
    `thread_cpu` is the stepping thread's CPU seconds at the end of the last step."""

    def __init__(
        self, tokens: int = 3, *, max_model_len: int = 64, step_ms: float = 0.0,
        engine_us: float = 0.0,
    ) -> None:  # fmt: skip
        self.tokenizer = StandInTokenizer()
        self.max_model_len, self.vocab_size = max_model_len, 100
        self.context = ContextLimit(
            max_model_len, f"the context is {max_model_len} tokens (the model's max_model_len)", ""
        )
        self.scheduler = _Counts(self)
        self.block_manager = SimpleNamespace(num_free_blocks=10, num_blocks=10)
        stats = SimpleNamespace(
            num_verify_steps=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[]
        )
        self.speculator = SimpleNamespace(
            stats=stats, last_k=0, steps_by_k={}, summary=lambda: None
        )
        self.tokens = tokens
        self.step_s, self.busy_s = step_ms / 1e3, engine_us / 1e6
        self.live: dict[str, int] = {}  # request id -> tokens given
        self.steps = 0
        self.thread_cpu = 0.0

    def validate(self, ids, params) -> None:
        if not ids:
            raise ValueError("the prompt is empty")

    def add_request(self, ids, params, request_id=None) -> None:
        self.live[request_id] = 0

    def abort(self, request_id) -> None:
        self.live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        until = time.perf_counter() + self.busy_s * len(self.live)
        while time.perf_counter() < until:
            pass
        outs = []
        for rid in list(self.live):
            n = self.live[rid] = self.live[rid] + 1
            done = n == self.tokens
            outs.append(
                RequestOutput(rid, None, [1], f"t{n}", [7], done, "length" if done else None, {})
            )
            if done:
                del self.live[rid]
        self.thread_cpu = time.thread_time()
        return outs
