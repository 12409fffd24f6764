"""kernel_times reads the GPU kernels a torch.profiler run saw, graph replays included."""

from __future__ import annotations

import pytest
import torch

from outrider.bench.step_profile import kernel_times, step_breakdown

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
