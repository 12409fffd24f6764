"""The grouped MoE GEMM's launch shapes on one GPU: each candidate MoeTile timed on the
Moonlight-16B-A3B experts (bf16, 64 routed + 2 shared, 8 a token) and the Kimi-K2.5 experts
(INT4 group 32, 384, 8 a token) at 1, 4, 16 and 64 tokens, gate_up (gated) and down apart,
with the share of copy bandwidth that the bytes of the experts the step reads make of it.

    python benchmarks/moe_gemm_tiles.py [--tokens 1 4 16 64] [--models kimi-k2.5] [--out-dir DIR]

Each time is a CUDA graph of 10 launches replayed (launch cost out of it), the median of 5
replays. Writes moe_gemm_tiles.json: every candidate's time, and the best tile per (model,
GEMM, tokens) beside moe_fused.moe_tile's choice, which was read from an earlier run of it;
for INT4 the chosen tile also with its nibbles dequantized one at a time
(moe_fused.INT4_DEQUANT_PAIRS off), the path before the PTX pairs, and the one-GEMV-a-row
kernel's launch shapes (moe_fused.moe_gemv); per point `default` is what moe_gemm runs given no
tile (what a model's step runs). --paths gemv skips the tile sweep (the chosen tile only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_graph, write_result  # noqa: E402
from gpu_decode import copy_bandwidth_gbs  # noqa: E402

# (name, experts in the stack, chosen a token, hidden, intermediate, INT4)
MODELS = [("moonlight-16b-a3b", 66, 8, 2048, 1408, False), ("kimi-k2.5", 384, 8, 7168, 2048, True)]
GROUP = 32


def candidates(int4: bool):
    from outrider.layers.moe_fused import MoeTile

    for n, k, warps, stages in itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4)):
        if warps == 8 and n < 64:
            continue
        yield MoeTile(n, k, warps, stages)
    if not int4:
        yield MoeTile(32, 64, 4, 4)
        yield MoeTile(64, 64, 4, 4)


def _timed(call, need: float, bandwidth: float) -> dict | None:
    """call's time (a graph of 10 launches, the median of 5 replays) and the share of copy
    bandwidth `need` bytes make of it; None where the launch shape does not fit an SM."""
    from triton.runtime.errors import OutOfResources

    try:
        with torch.inference_mode():
            ms = time_graph(call)
    except OutOfResources:  # shared memory past the SM's: not a candidate
        return None
    share = need / (ms / 1e3) / (bandwidth * 1e9)
    return {"ms": round(ms, 4), "share": round(share, 3)}


def gemv_candidates():
    from outrider.layers.moe_fused import GemvTile

    for n, k in itertools.product((32, 64, 128), (256, 512)):
        yield GemvTile(n, k, 4)
    yield GemvTile(64, 256, 8)
    yield GemvTile(128, 256, 8)


def random_experts(e: int, n: int, k: int, int4: bool, g: torch.Generator):
    """[e, n, k] bf16 experts, or INT4 packed words and bf16 scales of that shape."""
    dev = g.device
    if not int4:
        return (torch.randn(e, n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16), None
    words = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, device=dev,
                          generator=g)  # fmt: skip
    scale = torch.rand(e, n, k // GROUP, device=dev, generator=g) * 0.01
    return words, scale.to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--models", nargs="+", default=[m[0] for m in MODELS],
                    choices=[m[0] for m in MODELS])  # fmt: skip
    ap.add_argument(
        "--paths", nargs="+", default=["tiles", "gemv"], choices=["tiles", "gemv"],
        help="tiles: sweep the grouped GEMM's tiles (else time moe_tile's choice only); gemv: "
        "sweep the INT4 GEMV's launch shapes",
    )  # fmt: skip
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()

    from outrider.layers import moe_fused

    bandwidth = copy_bandwidth_gbs()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, e, k, h, inter, int4 in (m for m in MODELS if m[0] in args.models):
        gemms = {
            "gate_up": (random_experts(e, 2 * inter, h, int4, g), h, True),
            "down": (random_experts(e, h, inter, int4, g), inter, False),
        }
        for t in args.tokens:
            ids = torch.rand(t, e, device=dev, generator=g).topk(k, dim=-1).indices.reshape(-1)
            layout = moe_fused.moe_layout_no_sync(ids, e)
            touched = ids.unique().numel()  # CPU-GPU sync point: outside the timing
            for gemm, ((w, s), width, gated) in gemms.items():
                rows_per_a = k if gemm == "gate_up" else 1
                a = torch.randn(t * k // rows_per_a, width, device=dev, dtype=torch.bfloat16)
                per_expert = w[0].numel() * w.element_size()
                per_expert += s[0].numel() * s.element_size() if s is not None else 0
                need = touched * per_expert
                base = (a, ids, w, rows_per_a)

                def timed(fn, *extra, base=base, need=need) -> dict | None:
                    return _timed(functools.partial(fn, *base, *extra), need, bandwidth)

                group = GROUP if int4 else 0
                pick = moe_fused.moe_tile(ids.numel(), int4, gated)
                tiles = candidates(int4) if "tiles" in args.paths else [pick]
                rows = []
                for tile in tiles:
                    got = timed(moe_fused.moe_gemm, s, group, layout, gated, tile)
                    if got is not None:
                        rows.append({**dataclasses.asdict(tile), **got})
                best = min(rows, key=lambda r: r["ms"])
                want = dataclasses.asdict(pick)
                chosen = next(r for r in rows if all(r[k] == v for k, v in want.items()))
                print(f"{name} {gemm} T={t} experts {touched}: best {best} chosen "
                      f"{chosen['ms']} ms ({chosen['share']})", flush=True)  # fmt: skip
                row = {"model": name, "gemm": gemm, "tokens": t, "experts_touched": touched,
                       "bytes_gb": round(need / 1e9, 4), "best": best, "chosen": chosen,
                       "all": rows}  # fmt: skip
                if int4:  # the chosen tile again, its nibbles dequantized one at a time
                    moe_fused.INT4_DEQUANT_PAIRS = False
                    try:
                        row["chosen_per_element"] = timed(
                            moe_fused.moe_gemm, s, group, layout, gated, pick
                        )
                    finally:
                        moe_fused.INT4_DEQUANT_PAIRS = True
                    print(f"  per element: {row['chosen_per_element']}", flush=True)
                if int4 and "gemv" in args.paths:  # one GEMV a row
                    gemv = []
                    for tile in gemv_candidates():
                        got = timed(moe_fused.moe_gemv, s, group, gated, tile)
                        if got is not None:
                            gemv.append({**dataclasses.asdict(tile), **got})
                    row["gemv_best"] = min(gemv, key=lambda r: r["ms"])
                    row["gemv_all"] = gemv
                    print(f"  gemv best: {row['gemv_best']}", flush=True)
                # What a model's step runs: moe_gemm with no tile given.
                row["default"] = timed(moe_fused.moe_gemm, s, group, layout, gated)
                print(f"  moe_gemm's own choice: {row['default']}", flush=True)
                results.append(row)
    path = write_result(
        "moe_gemm_tiles",
        {"copy_bandwidth_gbs": round(bandwidth, 1), "group": GROUP, "results": results},
        args.out_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
