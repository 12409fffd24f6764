"""Offload: small jobs run inline on the event loop, large ones in its bounded pool of threads
with the same result, and long JSON arrays are written as json.dumps writes them."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from outrider.server.offload import INLINE_BYTES, Offload, json_array


def test_small_jobs_run_inline_and_large_ones_in_the_pool():
    offload = Offload(workers=2)

    async def run() -> list[str]:
        def where(x: int) -> str:
            return f"{threading.current_thread().name}:{x}"

        small = await offload.run(INLINE_BYTES, where, 1)
        large = await asyncio.gather(*(offload.run(INLINE_BYTES + 1, where, i) for i in range(4)))
        return [small, *large]

    try:
        small, *large = asyncio.run(run())
    finally:
        offload.close()
    assert small == f"{threading.current_thread().name}:1"
    assert [x.split(":")[1] for x in large] == ["0", "1", "2", "3"]
    assert all(x.startswith("outrider-offload") for x in large)


def test_a_job_that_raises_raises_in_the_caller():
    offload = Offload(workers=1)

    def fail() -> None:
        raise ValueError("no")

    async def run() -> None:
        await offload.run(1 << 20, fail)

    try:
        with pytest.raises(ValueError, match="no"):
            asyncio.run(run())
    finally:
        offload.close()


def test_json_array_is_json_dumps_in_slices():
    compact = {"ensure_ascii": False, "separators": (",", ":")}
    for values in ([], [1], list(range(200_000)), ["a", 'é\n"', "東"] * 30_000):
        assert json_array(values) == json.dumps(values, **compact)
