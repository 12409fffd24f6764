"""The deterministic mode's GEMM tile schedules, timed: every candidate schedule of
layers/batch_invariant.py's `matmul` (tile M x N x K, warps, stages, K splits) at the weight
shapes the default model, its EAGLE-3 drafter and the Llama-3.1-8B shape run, each at the row
counts decode and verify meet (1, 4, 16, 64, 256), inside CUDA graphs as the engine replays
them; beside cuBLAS (F.linear, the default mode) and the schedule `gemm_config` picks now.

    python benchmarks/deterministic_gemm.py [--rows 1 4 16 64 256] [--shapes smollm2 llama8b]
        [--out-dir DIR]

A schedule may depend on (N, K) and never on M (a row's bits must not depend on the batch), so
one schedule serves every row count of a shape: each is scored by the mean over row counts of
its time over the best time any schedule got at that row count, and the lowest score wins.
Reported per shape: the winner, the current pick and cuBLAS, us per call at every row count;
and every timing (`runs`) for fitting `gemm_config`'s rule. Writes
benchmarks/results/deterministic_gemm.json. CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_graph, write_result  # noqa: E402

# (name, K, N): x [M, K] @ W[N, K]^T
SHAPES = {
    "smollm2": [
        ("smollm2.qkv", 576, 960), ("smollm2.o", 576, 576), ("smollm2.gate_up", 576, 3072),
        ("smollm2.down", 1536, 576), ("smollm2.lm_head", 576, 49152),
        ("eagle3.fc", 1728, 576), ("eagle3.qkv", 1152, 960), ("eagle3.lm_head", 576, 16384),
    ],
    "llama8b": [
        ("llama8b.qkv", 4096, 6144), ("llama8b.o", 4096, 4096),
        ("llama8b.gate_up", 4096, 28672), ("llama8b.down", 14336, 4096),
        ("llama8b.lm_head", 4096, 128256),
    ],
}  # fmt: skip
SMEM_BYTES = 220 * 1024  # Hopper's 227 KB less the kernel's own


def tiles() -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) candidates whose pipelined tiles fit in
    shared memory."""
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        (32, 64, 128), (32, 64, 128, 256), (64, 128), (4, 8), (3, 4)
    ):
        if bm == 32 and (warps != 4 or bn not in (64, 128)):
            continue
        if bm == 128 and (warps != 8 or bn not in (64, 128) or bk != 64):
            continue
        if (bm + bn) * bk * 2 * stages > SMEM_BYTES:
            continue
        out.append((bm, bn, bk, warps, stages))
    return out


def shape_runs(name: str, k: int, n: int, rows: list[int], sms: int) -> dict:
    import torch
    import torch.nn.functional as F

    from outrider.layers.batch_invariant import GemmConfig, gemm_config, matmul, split_k

    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    xs = {m: torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in rows}
    cublas = {m: 1e3 * time_graph(lambda m=m: F.linear(xs[m], w)) for m in rows}
    now = gemm_config(torch.bfloat16, n, k, sms)
    configs = []
    for bm, bn, bk, warps, stages in tiles():
        auto = split_k(n, k, sms, bn, bk)[0]
        seen = set()
        for want in (1, auto, 2 * auto):
            splits, per = split_k(n, k, sms, bn, bk, want=want)
            if splits not in seen:
                seen.add(splits)
                configs.append(GemmConfig(bm, bn, bk, warps, stages, splits, per))
    if now not in configs:
        configs.append(now)
    runs = []
    for cfg in configs:
        try:
            us = {
                m: 1e3 * time_graph(lambda m=m, cfg=cfg: matmul(xs[m], w, config=cfg)) for m in rows
            }
        except Exception as e:  # a schedule that does not compile or fit: skip it
            print(f"{name}: {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        runs.append({"config": cfg.__dict__, "us": us})
    best = {m: min(r["us"][m] for r in runs) for m in rows}
    for r in runs:
        r["score"] = statistics.mean(r["us"][m] / best[m] for m in rows)
    runs.sort(key=lambda r: r["score"])
    current = next(r for r in runs if r["config"] == now.__dict__)
    win = runs[0]

    def fmt(us: dict) -> str:
        return " ".join(f"{us[m]:.1f}" for m in rows)

    print(f"{name} [{k} -> {n}] rows {rows}\n  cuBLAS  {fmt(cublas)}\n"
          f"  now     {fmt(current['us'])} score {current['score']:.2f} {now}\n"
          f"  winner  {fmt(win['us'])} score {win['score']:.2f} {win['config']}", flush=True)  # fmt: skip
    return {
        "gemm": name, "in": k, "out": n, "cublas_us": cublas,
        "current": current, "winner": win, "top": runs[:5], "runs": runs,
        "winner_vs_cublas": {m: win["us"][m] / cublas[m] for m in rows},
        "current_vs_cublas": {m: current["us"][m] / cublas[m] for m in rows},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default="deterministic_gemm", help="result name")
    ap.add_argument("--out-dir", default=None, help="directory for the JSON (e.g. $OUT)")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("deterministic_gemm.py times CUDA kernels: run it on a GPU machine")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [s for group in args.shapes for s in SHAPES[group]]
    results = [shape_runs(name, k, n, args.rows, sms) for name, k, n in shapes]
    path = write_result(
        args.out,
        {"rows": args.rows, "sms": sms, "tiles": len(tiles()), "shapes": results},
        args.out_dir,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
