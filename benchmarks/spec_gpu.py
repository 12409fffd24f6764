"""Speculative decoding on a GPU, side by side in one run: plain vs n-gram vs EAGLE-3 (chain and
tree) on the default model, batch 1 and a few concurrencies, greedy; tok/s, accept length,
and whether the speculative output equals the plain one.

    python benchmarks/spec_gpu.py --draft DIR [--concurrency 1 4 16] [--new-tokens 256]

Prompts: outrider/bench/datasets.HELDOUT (never in drafter training) and GROUNDED. Writes
benchmarks/results/spec_gpu.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        _sync()


def run(llm, convs, concurrency: int, new_tokens: int) -> dict:
    from outrider import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    llm.chat(convs[:2], SamplingParams(temperature=0, max_tokens=8))  # warm up
    _sync()
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(convs), concurrency):
        outs += llm.chat(convs[i : i + concurrency], params)
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    return {
        "tok_per_s": round(tokens / dt, 1),
        "accept_length": round(1 + accepted / steps, 3) if steps else None,
        "ids": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--draft", default=None, help="EAGLE-3 drafter dir (default: the shipped one)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from outrider import LLM
    from outrider.bench.datasets import GROUNDED, HELDOUT

    sets = {"heldout": HELDOUT, "grounded": GROUNDED}
    configs = {
        "plain": None,
        "ngram_k4": {"method": "ngram", "num_draft_tokens": 4},
        "eagle3_chain_k4": {"method": "eagle3", "draft": args.draft, "num_draft_tokens": 4},
        "eagle3_tree_k8": {"method": "eagle3", "draft": args.draft, "num_draft_tokens": 8,
                           "topk": 3, "num_steps": 4},
    }  # fmt: skip
    result: dict = {"dtype": args.dtype, "new_tokens": args.new_tokens, "runs": {}}
    for name, spec in configs.items():
        memory = {"gpu_memory_utilization": 0.3} if args.device.startswith("cuda") else {}
        llm = LLM(dtype=args.dtype, device=args.device, speculative=spec, **memory)
        for set_name, prompts in sets.items():
            convs = [[{"role": "user", "content": p}] for p in prompts]
            for c in args.concurrency:
                key = f"{set_name}_c{c}"
                row = run(llm, convs, c, args.new_tokens)
                result["runs"].setdefault(key, {})[name] = row
                print(f"{name:16s} {key:12s} {row['tok_per_s']:>9} tok/s  "
                      f"accept {row['accept_length']}", flush=True)  # fmt: skip
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for runs in result["runs"].values():
        plain = runs["plain"]
        plain_ids = plain.pop("ids")
        for name, row in runs.items():
            if name == "plain":
                continue
            ids = row.pop("ids")
            row["speedup"] = round(row["tok_per_s"] / plain["tok_per_s"], 2)
            # bf16 batched verify may flip near-tie argmaxes; fp32 equality is what tests assert
            row["same_output_fraction"] = round(
                sum(a == b for a, b in zip(ids, plain_ids)) / len(ids), 2
            )
    print(f"wrote {write_result('spec_gpu', result)}")


if __name__ == "__main__":
    main()
