"""Work that grows with a request's text (templating, tokenizing, detokenizing, writing a long
/tokenize answer): on the event loop while the body is small, in a bounded pool of threads once
it is large, so that no request stalls /health or another request's stream.

A thread helps only while the work lets go of the GIL: the tokenizer's batch calls release it
while Rust runs (loaders/tokenizer.py), and Python code gives it up every few milliseconds. A
single C call over a whole large input (json.dumps of a million ids) holds it throughout, so
large outputs are written in slices (json_array).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Bodies up to this size are worked on inline: tokenizing ~4k characters takes ~3 ms, about
# what a hop to a thread and back costs the loop in wake-ups under load.
INLINE_BYTES = 4096
# Large inputs tokenized at once; more wait their turn. The work is CPU-bound and lets go of
# the GIL, so more threads than this gain nothing on the cores a server has to spare.
WORKERS = min(4, os.cpu_count() or 1)
_SLICE = 65536  # values json_array writes per C call: ~5 ms


class Offload:
    """Runs `fn(*args)` inline or in the pool by the size of the request it serves.

    Invariant: at most WORKERS large jobs run at once; small jobs never wait behind them."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="outrider-offload")

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        if size <= INLINE_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        """Drop queued jobs and stop the threads once running ones end (any thread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def json_array(values: Sequence) -> str:
    """json.dumps(values) as starlette's JSONResponse writes it (no spaces, non-ASCII kept),
    in slices: between two the GIL can pass to the event loop."""
    dump = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))
    parts = (dump(values[i : i + _SLICE])[1:-1] for i in range(0, len(values), _SLICE))
    return "[" + ",".join(parts) + "]"
