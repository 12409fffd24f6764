"""kernel_times reads the GPU kernels a torch.profiler run saw, graph replays included."""

from __future__ import annotations

import random

import pytest
import torch

from outrider.bench.step_profile import step_breakdown
from outrider.executor.step_timing import kernel_times

pytestmark = pytest.mark.gpu


def test_kernel_times_sees_gemms_inside_a_cuda_graph():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm cuBLAS up outside the capture
        torch.matmul(a, w.t(), out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.matmul(a, w.t(), out=out)
        torch.nn.functional.silu(out, inplace=True)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with prof:
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
    times = kernel_times(prof)
    assert len(times) >= 8 and all(us > 0 for _, us in times)
    out = step_breakdown(times, steps=4, step_ms=1.0, roofline_ms=0.01)
    assert out["gemm_ms"] > 0 and out["other_kernels_ms"] > 0, out
    assert out["kernels_per_step"] >= 2


def test_profile_steps_measures_the_device_share_of_each_step():
    """The engine's own steps on the default model's shape (random weights): each step's
    device time is less than the step (the host builds inputs and reads the result back),
    more where the step verifies more tokens, and no less than its kernels' durations summed
    (the span holds them and the gaps between them)."""
    from outrider.config import EngineConfig
    from outrider.executor.model_runner import ModelRunner
    from outrider.executor.step_timing import profile_steps
    from tests.benchmarks import load_benchmark

    gpu_decode = load_benchmark("gpu_decode.py")
    checkpoint = gpu_decode.random_checkpoint(gpu_decode.SMOLLM2_135M, tied_head=True)
    config = EngineConfig.from_dict({
        "model": {"model": str(checkpoint.path), "device": "cuda", "dtype": "bfloat16"},
        "speculative": {"method": "ngram", "num_draft_tokens": 7},
        "cache": {"gpu_memory_utilization": 0.1},
    })  # fmt: skip
    runner = ModelRunner(config, checkpoint)
    runner.set_speculation(None, (7,))
    runner.capture_graphs()
    steps, device = profile_steps(runner, (7,), (1, 16), reps=5, device_time=True)
    for b in (1, 16):
        for k in (0, 7):
            assert 0 < device[b][k] < steps[b][k], (b, k, device[b][k], steps[b][k])
    assert device[16][7] > device[1][0]
    _, none = profile_steps(runner, (7,), (1,), reps=1)
    assert none is None
    # Last: once the profiler has traced a step, later launches in this process are slower.
    from torch.profiler import ProfilerActivity, profile

    from outrider.executor.step_timing import _dummy_batch

    batch = _dummy_batch(runner, random.Random(0), 16, 7)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run_spec(batch, 7, 0)
        torch.cuda.synchronize()
    kernels_ms = sum(us for _, us in kernel_times(prof)) / 1e3
    assert device[16][7] >= 0.95 * kernels_ms, (device[16][7], kernels_ms)
