"""Timing the engine's own steps on dummy rows: what the adaptive controller starts from and
what `outrider plan --calibrate` fits the cost model to.

A step is timed as the engine runs it (inputs built, graphs replayed where captured, the host
read at the end), on rows in the scratch block, so no request's KV is touched. On CUDA the
device's share can be measured too: its kernels' durations (torch.profiler, CUPTI), summed.
The rest of the step's wall time is the host's (Python, input copies, the graph launch, the
read back); the cost model prices the two apart.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.progress import progress
from outrider.speculative.base import SeqDrafts

DEVICE_REPS = 3  # profiled steps per shape: CUPTI's kernel times vary little run to run


def profile_steps(
    runner,  # executor.model_runner.ModelRunner
    ks: Sequence[int],
    batch_sizes: Sequence[int] | None = None,
    reps: int | None = None,
    device_time: bool = False,
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]] | None]:
    """({batch: {k: ms of one step}}, the same of the device's kernel time or None) at each
    batch size and k: 0 is a plain decode step, k >= 1 the speculative step with k drafts (and
    a drafter's k next drafts). Median of `reps` after a warm-up. The device's table is
    measured only on CUDA with `device_time`, in steps of their own after all the timed ones.

    Defaults: with graphs, every captured batch size, 10 each (replays are ~2 ms: ~1 s in
    all, and one slow outlier stays out of the median; 3 once let a 26 ms plain step at
    B=64 through); eagerly (the CPU: 40-200 ms steps that vary +-20% run to run) batch 1
    and 4, 4 each, past which the controller extrapolates."""
    graphs = runner.graphs is not None
    if batch_sizes is None:
        batch_sizes = runner.spec_step.batch_sizes if graphs else (1, 4)
    if reps is None:
        reps = 10 if graphs else 4
    device_time = device_time and runner.device.type == "cuda"
    # Tokens spread over the vocabulary, not one token everywhere: an MoE model routes
    # each row to its own experts as a real batch does (token 0 in every row read the same
    # 8 of Kimi-K2.5's 384 experts where 64 real tokens read ~284).
    rng = random.Random(0)
    table: dict[int, dict[int, float]] = {}
    steps = {}
    for b in progress(batch_sizes, "measuring speculative steps"):
        table[b] = {}
        for k in sorted({0, *ks}):
            steps[b, k] = step = _step(runner, _dummy_batch(runner, rng, b, k), k)
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                step()
                if i:  # the first one warms up
                    times.append((time.perf_counter() - t0) * 1e3)
            table[b][k] = sorted(times)[len(times) // 2]
    if not device_time:
        return table, None
    # Profiled after every timed step: once CUPTI has traced a step, launches stay slower in
    # this process (the default model's steps by ~0.5 ms on the H200).
    device: dict[int, dict[int, float]] = {b: {} for b in table}
    for (b, k), step in steps.items():
        device[b][k] = _kernel_ms(step)
    return table, device


def _dummy_batch(runner, rng: random.Random, b: int, k: int) -> ScheduledBatch:
    """b rows of 1 + k random tokens at position 0, each in the scratch block."""
    params = SamplingParams(temperature=0, max_tokens=None)
    vocab = runner.model_config.vocab_size
    rows = [[rng.randrange(vocab) for _ in range(1 + k)] for _ in range(b)]
    seqs = [
        ScheduledSeq(
            Request(prompt_token_ids=[0], params=params), row, 0,
            [runner.num_blocks], True, SeqDrafts.chain(row[1:]) if k else None,
        )
        for row in rows
    ]  # fmt: skip
    return ScheduledBatch(ForwardMode.VERIFY if k else ForwardMode.DECODE, seqs)


def _step(runner, batch: ScheduledBatch, k: int):
    k_draft = k if runner.drafter is not None else 0
    if k:
        return lambda: runner.run_spec(batch, k, k_draft)
    return lambda: runner.run(batch)


def _kernel_ms(step) -> float:
    """The device's busy time in one step: its kernels', copies' and fills' durations summed,
    averaged over DEVICE_REPS steps (each ends in the host read, so none overlaps the next).
    Not the span from the first kernel to the last: under the profiler the gaps between a
    graph's kernels grow, and the default model's spans on the H200 came out longer than its
    unprofiled steps. What the sum leaves out (the gaps, the host) the calibration reads as
    the host's (plan/calibrate.py)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(DEVICE_REPS):
            step()
        torch.cuda.synchronize()
    return sum(us for _, us in kernel_times(prof)) / DEVICE_REPS / 1e3


def kernel_times(prof) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel, copy and fill a torch.profiler run recorded
    (kernels replayed inside CUDA graphs included)."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
