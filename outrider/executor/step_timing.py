"""Timing the engine's own steps on dummy rows: what the adaptive controller starts from and
what `outrider plan --calibrate` fits the cost model to.

A step is timed as the engine runs it (inputs built, graphs replayed where captured, the host
read at the end), on rows at position 0, each in blocks of its own: the pool's first ones,
which hold no request's KV yet when the engine times its steps at start-up (or `outrider plan
--calibrate` times a runner of its own). Rows sharing one block attended to one another's KV,
so in a random-weight MoE model every row's hidden state drifted to the same experts: 16 rows
read 20-27 of 64 experts a layer where 16 served requests read ~51, and Moonlight's plain step
of 16 timed 5.3 ms where the engine's takes 10.9. On CUDA the
device's share can be measured too (`device_ms`): the same step's device work queued several
times over, the first behind a GPU sleep, each next one while the device runs the last, so
the device runs them back to back, never waiting on Python, with a CUDA event between two
steps. What a span holds is what the device does: the input copy, every kernel and the gaps
a graph leaves between them, at the clocks a sustained run holds. The rest of the step's wall
time is the host's (Python, input packing, the graph launch, the read back); the cost model
prices the two apart.

Why not the profiler. CUPTI's kernel durations summed leave out the gaps between a graph's
kernels and the clocks the device drops to under a sustained load (an 8B verify of 64 x 16
rows ran 4 ms past its kernels' sum, which the fit then took for host time), and once CUPTI
has traced a step every later launch in the process is slower (the default model's steps by
~0.5 ms on the H200), so models had to be measured in processes of their own, whose hosts
differed by 0.2-0.3 ms a step.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.layers import cpu_gemm
from outrider.progress import progress
from outrider.speculative.base import SeqDrafts

if TYPE_CHECKING:  # the runner's profile_steps calls in here: at run time a cycle
    from outrider.executor.model_runner import ModelRunner

# What the profile cache's key says of how steps are timed: a kept profile timed otherwise is
# measured again (engine/speculation.py).
METHOD = "rows at position 0 in blocks of their own"
DEVICE_REPS = 5  # device-timed steps per shape (median): a replay varies by a few percent
DEVICE_WARM = 3  # steps before them, so the device's clocks settle as in a sustained run


def gemm_form(device: torch.device) -> str:
    """The form of the GEMM a step runs on `device` (layers/cpu_gemm.py), part of what a kept
    profile was timed with."""
    return cpu_gemm.FORM if device.type == "cpu" else "F.linear"


def profile_steps(
    runner: ModelRunner,
    ks: Sequence[int],
    batch_sizes: Sequence[int] | None = None,
    reps: int | None = None,
    device_time: bool = False,
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]] | None]:
    """({batch: {k: ms of one step}}, the same of the device's time or None) at each batch
    size and k: 0 is a plain decode step, k >= 1 the speculative step with k drafts (and a
    drafter's k next drafts). The median of `reps` rounds, each of which times every shape once
    in turn: a machine busy for a while slows every shape alike rather than the few timed then
    (on a shared 2-core machine, shape by shape, a k = 4 step read 2.4x a plain one where it
    ran 1.8x). The device's table is measured only on CUDA with `device_time` (`device_ms`),
    after the rounds.

    Defaults: with graphs, every captured batch size, 10 rounds after one that warms up
    (replays are ~2 ms: ~1 s in all, and one slow outlier stays out of the median; 3 once let a
    26 ms plain step at B=64 through); eagerly (the CPU: 40-200 ms steps) batch 1 and 4 and 3
    rounds, the first of which warms up too (the median leaves it out): 30 steps for k = 0..4,
    where 4 timed after a warm-up, shape by shape, took 50 and most of a CPU server's start-up.
    Past the largest batch size the controller extrapolates, and the steps the engine runs
    correct the table as it serves (SpecController.record_step)."""
    graphs = runner.graphs is not None
    if batch_sizes is None:
        batch_sizes = default_batch_sizes(runner)
    if reps is None:
        reps = 10 if graphs else 3
    device_time = device_time and runner.device.type == "cuda"
    # Tokens spread over the vocabulary, not one token everywhere: an MoE model routes
    # each row to its own experts as a real batch does (token 0 in every row read the same
    # 8 of Kimi-K2.5's 384 experts where 64 real tokens read ~284).
    rng = random.Random(0)
    shapes = [(b, k) for b in batch_sizes for k in sorted({0, *ks})]
    batches = {s: _dummy_batch(runner, rng, *s) for s in shapes}
    steps = {(b, k): _step(runner, batches[(b, k)], k) for b, k in shapes}
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    warm = 1 if graphs else 0  # a graph's first replay is not timed; eagerly the median drops it
    for r in progress(range(warm + reps), "measuring speculative steps"):
        for shape in shapes:
            t0 = time.perf_counter()
            steps[shape]()
            if r >= warm:
                times[shape].append((time.perf_counter() - t0) * 1e3)
    table: dict[int, dict[int, float]] = {b: {} for b in batch_sizes}
    device: dict[int, dict[int, float]] = {b: {} for b in batch_sizes}
    for (b, k), ts in times.items():
        table[b][k] = sorted(ts)[len(ts) // 2]
        if device_time:
            device[b][k] = device_ms(runner, batches[(b, k)], k, table[b][k])
    return table, (device if device_time else None)


def default_batch_sizes(runner: ModelRunner) -> tuple[int, ...]:
    """The batch sizes profile_steps times when given none: every captured one, else 1 and 4
    (no more than the speculative step holds: cuda_graph_max_batch sizes it on the CPU too)."""
    if runner.graphs is not None:
        return tuple(runner.spec_step.batch_sizes)
    most = max(runner.spec_step.batch_sizes) if runner.spec_step is not None else 4
    return tuple(sorted({1, min(4, most)}))


def _dummy_batch(runner: ModelRunner, rng: random.Random, b: int, k: int) -> ScheduledBatch:
    """b rows of 1 + k random tokens at position 0, each in blocks of its own (the pool's
    first ones, taken again from the start where the pool has fewer than the rows need)."""
    params = SamplingParams(temperature=0, max_tokens=None)
    vocab = runner.model_config.vocab_size
    rows = [[rng.randrange(vocab) for _ in range(1 + k)] for _ in range(b)]
    per_row = -(-(1 + k) // runner.block_size)
    seqs = [
        ScheduledSeq(
            Request(prompt_token_ids=[0], params=params), row, 0,
            [(i * per_row + j) % runner.num_blocks for j in range(per_row)], True,
            SeqDrafts.chain(row[1:]) if k else None,
        )
        for i, row in enumerate(rows)
    ]  # fmt: skip
    return ScheduledBatch(ForwardMode.VERIFY if k else ForwardMode.DECODE, seqs)


def _step(runner: ModelRunner, batch: ScheduledBatch, k: int) -> Callable[[], object]:
    k_draft = k if runner.drafter is not None else 0
    if k:
        return lambda: runner.run_spec(batch, k, k_draft)
    return lambda: runner.run(batch)


def device_ms(runner: ModelRunner, batch: ScheduledBatch, k: int, step_ms: float) -> float:
    """The device's time in one step of `batch` (k drafts; 0: decode), unprofiled: the median
    span of DEVICE_REPS steps run back to back after DEVICE_WARM others. Each step's device
    work is what `run` / `run_spec` queue before their one host read (the input copy, the
    graphs, sampling or acceptance and drafting). The first is queued behind a GPU sleep of
    twice the step's wall time `step_ms`, longer than the host takes to queue it; each next
    one is queued while the device runs the one before (the input upload waits only for the
    previous step's copy), so the device never waits on the host and an event between two
    steps marks where one ends and the next begins. The spans hold the steps' work and the
    gaps between their kernels, not the host's, at the clocks a sustained run holds: one step
    timed alone after the sleep ran at the clocks of a rested device (an 8B verify of 64 x 16
    rows 14% faster than in the engine's loop). Reads nothing back but the events."""
    spec = runner.spec_step
    if k and spec.tree is not None:
        n = spec.tree.num_nodes

        def queue() -> None:
            spec.run_no_sync(batch, n, n)
    elif k:
        k_draft = k if runner.drafter is not None else 0

        def queue() -> None:
            spec.run_no_sync(batch, k, k_draft)
    else:

        def queue() -> None:
            runner.launch(batch)

    cycles = int(2 * step_ms * _cycles_per_ms(runner.device))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(DEVICE_WARM + DEVICE_REPS + 1)]
    with torch.inference_mode():
        torch.cuda.synchronize(runner.device)  # CPU-GPU sync point: the timed steps' start
        torch.cuda._sleep(cycles)
        events[0].record()
        for e in events[1:]:
            queue()
            e.record()
        events[-1].synchronize()  # CPU-GPU sync point: the last step's end
    spans = [a.elapsed_time(b) for a, b in zip(events[DEVICE_WARM:], events[DEVICE_WARM + 1 :])]
    return sorted(spans)[len(spans) // 2]


@functools.cache
def _cycles_per_ms(device: torch.device) -> float:
    """How many cycles `torch.cuda._sleep` spins a millisecond on this device (its clock under
    that load), measured once: 20 million cycles (~10 ms at 2 GHz) timed by events."""
    probe = 20_000_000
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(probe // 10)  # the clock ramps up
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()  # CPU-GPU sync point: once per process
    return probe / start.elapsed_time(end)


def kernel_times(prof) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel, copy and fill a torch.profiler run recorded
    (kernels replayed inside CUDA graphs included)."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
