"""Where a decode step's time goes, from the GPU kernels a profiler saw: weight GEMMs,
attention, the other kernels (norms, rotary, activations, reductions) and the time the GPU ran
no kernel at all (launch gaps inside the graph and host work between steps). Benchmarks put it
beside the roofline so a shortfall names its cause."""

from __future__ import annotations

from collections.abc import Iterable

# Substrings of kernel names (lower case), first match wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "attn", "decode_split", "merge_splits", "write_kv", "flash")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas", "matmul")),
)


def kind(name: str) -> str:
    """'gemm', 'attention' or 'other' for a kernel's name."""
    low = name.lower()
    for k, marks in KINDS:
        if any(m in low for m in marks):
            return k
    return "other"


def step_breakdown(
    kernels: Iterable[tuple[str, float]], steps: int, step_ms: float, roofline_ms: float
) -> dict:
    """kernels: (name, us) over `steps` profiled steps; step_ms: the measured step (unprofiled);
    roofline_ms: bytes read per step / copy bandwidth. -> per-step milliseconds by kind, the
    idle rest, kernels per step and the five costliest 'other' kernels."""
    if steps < 1:
        raise ValueError(f"steps={steps}: profile at least one step")
    by_kind = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    other: dict[str, float] = {}
    count = 0
    for name, us in kernels:
        k = kind(name)
        by_kind[k] += us
        if k == "other":
            other[name] = other.get(name, 0.0) + us
        count += 1
    per = {k: v / 1e3 / steps for k, v in by_kind.items()}
    busy = sum(per.values())
    top = sorted(other.items(), key=lambda kv: -kv[1])[:5]
    return {
        "step_ms": round(step_ms, 3),
        "roofline_ms": round(roofline_ms, 3),
        "gemm_ms": round(per["gemm"], 3),
        "attention_ms": round(per["attention"], 3),
        "other_kernels_ms": round(per["other"], 3),
        "idle_ms": round(max(step_ms - busy, 0.0), 3),
        "kernels_per_step": round(count / steps, 1),
        "top_other_ms": {name[:60]: round(us / 1e3 / steps, 4) for name, us in top},
    }
