"""What the deterministic mode costs and whether it holds: plain, n-gram and EAGLE-3 (chain
and tree) through `LLM`, greedy, bf16, in the default mode and the deterministic mode
side by side in one run, at C in {1, 16, 64}; then, with --llama8b, plain and n-gram decode of
the Llama-3.1-8B shape (random bf16 weights) in both modes. First, always, the attention
kernels and the GEMMs alone (`attention_runs`, `gemm_runs`; --attention-only stops there).

    python benchmarks/deterministic.py [--concurrency 1 16 64] [--new-tokens 256]
        [--configs ngram eagle3_chain eagle3_tree] [--rounds 2] [--num-prompts 30] [--draft DIR]
        [--llama8b] [--attention-only] [--skip-kernels] [--profile C ...] [--out-dir DIR]

Each C runs every (mode, config) engine on the held-out prompts (HELDOUT, then HELDOUT_FRESH) as
one-turn chats in batches of C, `--rounds` times in a rotated order; tok/s is the median over
rounds. Reported per mode and C: tok/s, accept length, speedup over the same mode's plain, and
`identical`: how many outputs equal the same mode's plain output token for token. Also the
deterministic plain outputs at every C against C=1's (the same request alone or in any batch),
the first C's run again through the same engine (every prompt a prefix-cache hit) and through
one whose prefills are cut into 64-token chunks, seeded sampling (temperature 0.8, top-p 0.9) at
the largest C: each speculative config's samples against the same mode's plain ones, and the
cost table: deterministic plain tok/s over default plain tok/s, and each speculative config's
deterministic speedup over its default speedup; with --profile, where each mode's GPU time goes
(kernel_profiles). Writes benchmarks/results/deterministic.json.
CUDA only (the CPU's deterministic mode is a correctness mode, one GEMV per row).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

MODES = ("default", "deterministic")
CONFIGS = ("ngram", "eagle3_chain", "eagle3_tree")


def engine_specs(k: int, draft: str | None) -> dict[str, dict | None]:
    """Config name -> `speculative=` for LLM (None: plain); the tree is spec_gpu.py's default
    shape (8 nodes, top 3, 4 steps)."""
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_draft_tokens": k, "controller": "fixed"},
        "eagle3_chain": {"method": "eagle3", "draft": draft, "num_draft_tokens": k,
                         "controller": "fixed"},
        "eagle3_tree": {"method": "eagle3", "draft": draft, "num_draft_tokens": 8, "topk": 3,
                        "num_steps": 4, "controller": "fixed"},
    }  # fmt: skip


def identical(ids: list[list[int]], want: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(ids, want, strict=True))


def default_model_runs(args) -> dict:
    from spec_gpu import batches, timed_run

    from outrider import LLM, SamplingParams
    from outrider.bench.datasets import HELDOUT, HELDOUT_FRESH

    prompts = (HELDOUT + HELDOUT_FRESH)[: args.num_prompts]
    convs = [[{"role": "user", "content": p}] for p in prompts]
    specs = engine_specs(args.k, args.draft)
    specs = {n: specs[n] for n in ["plain", *args.configs]}
    llms, errors = {}, {}
    for mode in MODES:
        for cfg, spec in specs.items():
            try:
                llm = LLM(
                    dtype="bfloat16", device="cuda", speculative=spec, num_blocks=4096,
                    deterministic=mode == "deterministic",
                )  # fmt: skip
            except Exception as e:  # record and go on: a missing drafter costs one config
                if cfg == "plain":
                    raise
                errors[f"{mode}/{cfg}"] = f"{type(e).__name__}: {e}"
                print(f"{mode}/{cfg} failed to build: {errors[f'{mode}/{cfg}']}", flush=True)
                continue
            warm = batches(convs, max(args.concurrency))[0]
            llm.chat(warm, SamplingParams(temperature=0, max_tokens=16))  # kernels, graphs
            llms[(mode, cfg)] = llm
    runs: dict = {}
    keys = list(llms)
    for c in args.concurrency:
        tries: dict = {key: [] for key in keys}
        for r in range(args.rounds):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                tries[key].append(timed_run(llms[key], convs, c, args.new_tokens, "cuda"))
        for (mode, cfg), rows in tries.items():
            last = {k: v for k, v in rows[-1].items() if k not in ("ids", "step_split")}
            last["tok_per_s"] = round(statistics.median(t["tok_per_s"] for t in rows), 2)
            last["tok_per_s_rounds"] = [t["tok_per_s"] for t in rows]
            last["ids"] = rows[0]["ids"]
            runs.setdefault(f"c{c}", {}).setdefault(mode, {})[cfg] = last
        for mode in MODES:
            row = runs[f"c{c}"].get(mode, {})
            plain = row.get("plain")
            for cfg, r in row.items():
                r["speedup"] = round(r["tok_per_s"] / plain["tok_per_s"], 3)
                r["identical"] = f"{identical(r['ids'], plain['ids'])}/{len(plain['ids'])}"
                acc = r["accept_length"]
                print(f"C={c:<3d} {mode:14s} {cfg:13s} {r['tok_per_s']:>9.1f} tok/s "
                      f"{r['speedup']:>5.2f}x accept {'-' if acc is None else acc} "
                      f"identical {r['identical']}", flush=True)  # fmt: skip
    across = {}  # the deterministic plain outputs at every C against C=1's
    first = runs[f"c{args.concurrency[0]}"]["deterministic"]["plain"]["ids"]
    for c in args.concurrency:
        ids = runs[f"c{c}"]["deterministic"]["plain"]["ids"]
        n = min(len(ids), len(first))  # batches cycle prompts: compare the first pass
        across[str(c)] = f"{identical(ids[:n], first[:n])}/{n}"
    # The same requests again through the same engine (every prompt a prefix-cache hit) and
    # through one whose prefills are cut into 64-token chunks: the first C's outputs again.
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    first_c = args.concurrency[0]
    det_plain = llms[("deterministic", "plain")]
    hits_before = det_plain.engine.scheduler.block_manager.stats.hit_tokens
    again = [o.token_ids for b in batches(convs, first_c) for o in det_plain.chat(b, params)]
    hit_tokens = det_plain.engine.scheduler.block_manager.stats.hit_tokens - hits_before
    sampled = seeded_sampling(llms, convs, max(args.concurrency), args.new_tokens)
    profiles = kernel_profiles(llms, convs, args.profile) if args.profile else {}
    del llms
    gc.collect()
    chunked = LLM(dtype="bfloat16", device="cuda", num_blocks=4096, deterministic=True,
                  max_num_batched_tokens=64, enable_prefix_caching=False)  # fmt: skip
    cut = [o.token_ids for b in batches(convs, first_c) for o in chunked.chat(b, params)]
    del chunked
    gc.collect()
    n = len(again)
    same = {
        "prefix_hit": f"{identical(again, first[:n])}/{n}",
        "prefix_hit_tokens": hit_tokens,
        "chunked_prefill_64": f"{identical(cut, first[:n])}/{n}",
    }
    print(f"deterministic plain at C={first_c} again: {same}", flush=True)
    for row in runs.values():
        for mode_rows in row.values():
            for r in mode_rows.values():
                r.pop("ids")
    return {"runs": runs, "errors": errors, "num_prompts": len(convs),
            "deterministic_plain_same_as_first_c": across,
            "deterministic_plain_same_as_first_c_run": same,
            "seeded_sampling_identical_to_plain": sampled, "profiles": profiles,
            "cost": cost_table(runs, args.concurrency)}  # fmt: skip


def kernel_profiles(llms: dict, convs: list, concurrency: list[int], new_tokens: int = 64) -> dict:
    """Where each mode's time goes: plain and EAGLE-3 (chain, tree), one batch of C chats of
    `new_tokens` under torch's profiler (CUDA kernels, graph replays included) -> per C and
    engine, wall and GPU-busy us per generated token, busy by kind (gemm / attention / other,
    outrider/bench/step_profile.py) and the twelve costliest kernels."""
    import torch
    from spec_gpu import batches
    from torch.profiler import ProfilerActivity, profile

    from outrider import SamplingParams
    from outrider.bench.step_profile import kind
    from outrider.executor.step_timing import kernel_times

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out: dict = {}
    for c in concurrency:
        batch = batches(convs, c)[0]
        for (mode, cfg), llm in llms.items():
            if cfg not in ("plain", "eagle3_chain", "eagle3_tree"):
                continue
            llm.chat(batch, params)  # the same shapes once before the profiled run
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                outs = llm.chat(batch, params)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            tokens = sum(len(o.token_ids) for o in outs)
            by_name: dict[str, float] = {}
            for name, us in kernel_times(prof):
                by_name[name] = by_name.get(name, 0.0) + us
            by_kind: dict[str, float] = {}
            for name, us in by_name.items():
                by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
            row = {
                "tokens": tokens,
                "wall_us_per_token": round(wall * 1e6 / tokens, 2),
                "busy_us_per_token": round(sum(by_name.values()) / tokens, 2),
                "by_kind_us_per_token": {k: round(v / tokens, 2) for k, v in by_kind.items()},
                "top_us_per_token": {n[:90]: round(us / tokens, 3) for n, us in top},
            }
            out.setdefault(f"c{c}", {})[f"{mode}/{cfg}"] = row
            print(f"profile C={c} {mode}/{cfg}: {row}", flush=True)
    return out


def seeded_sampling(llms: dict, convs: list, c: int, new_tokens: int) -> dict:
    """{mode: {cfg: "n/N"}}: each speculative config's seeded samples (temperature 0.8, top-p
    0.9, seed = the prompt's index, batches of c) equal to the same mode's plain ones, token
    for token. Seeded draws are keyed by (seed, position), and a speculative step accepts a
    draft exactly when it is plain sampling's draw there."""
    from spec_gpu import batches

    from outrider import SamplingParams

    out: dict = {}
    for mode in MODES:
        want = None
        for (m, cfg), llm in llms.items():
            if m != mode:
                continue
            ids = []
            for batch in batches(list(enumerate(convs)), c):
                params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=new_tokens)
                          for i, _ in batch]  # fmt: skip
                ids += [o.token_ids for o in llm.chat([conv for _, conv in batch], params)]
            ids = ids[: len(convs)]  # the first pass over the prompts
            if cfg == "plain":
                want = ids
            elif want is not None:
                out.setdefault(mode, {})[cfg] = f"{identical(ids, want)}/{len(want)}"
    print(f"seeded sampling, speculative equal to plain: {out}", flush=True)
    return out


def cost_table(runs: dict, concurrency: list[int]) -> dict:
    """{C: {"plain_tok_per_s_ratio": det / default, cfg: det speedup / default speedup}}: the
    issue's bars are >= 0.85 for plain (C=1, 64) and >= 0.90 for EAGLE-3's speedup."""
    out = {}
    for c in concurrency:
        row = runs[f"c{c}"]
        det, dflt = row.get("deterministic", {}), row.get("default", {})
        cell = {}
        if "plain" in det and "plain" in dflt:
            cell["plain_tok_per_s_ratio"] = round(
                det["plain"]["tok_per_s"] / dflt["plain"]["tok_per_s"], 3
            )
        for cfg in det:
            if cfg != "plain" and cfg in dflt:
                cell[f"{cfg}_speedup_ratio"] = round(det[cfg]["speedup"] / dflt[cfg]["speedup"], 3)
        out[str(c)] = cell
    return out


# (batch, context, query tokens a sequence): decode at C=1, 16 and 64, a chain verify of 1 + 4,
# and a 2048-token prefill chunk over a cached prefix.
ATTENTION_CASES = [(1, 1024, 1), (1, 8192, 1), (16, 2048, 1), (64, 2048, 1), (64, 8192, 1),
                   (1, 8192, 5), (64, 2048, 5), (1, 8192, 2048)]  # fmt: skip


# (name, in, out) of every GEMM a layer runs: the default model's (SmolLM2-135M: hidden 576,
# 9 / 3 heads of 64, MLP 1536) and Llama-3.1-8B's; and rows: decode at C=1, 16 and 64, and a
# chain verify of 1 + 4 at C=16 and 64.
GEMM_SHAPES = [("smollm2.qkv", 576, 960), ("smollm2.o", 576, 576),
               ("smollm2.gate_up", 576, 3072), ("smollm2.down", 1536, 576),
               ("llama8b.qkv", 4096, 6144), ("llama8b.o", 4096, 4096),
               ("llama8b.gate_up", 4096, 28672), ("llama8b.down", 14336, 4096)]  # fmt: skip
GEMM_ROWS = [1, 16, 64, 80, 320]


def gemm_runs() -> list[dict]:
    """The GEMMs alone, bf16: the deterministic mode's batch-invariant Triton GEMM
    (layers/batch_invariant.py `matmul`, one tile schedule for every row count) against the
    default mode's F.linear (cuBLAS, which picks its tiles and split-K by the rows), at every
    shape of GEMM_SHAPES and row count of GEMM_ROWS. us per call by triton's do_bench
    (median): where the deterministic mode's cost is, beside `attention_runs`."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from outrider.layers.batch_invariant import matmul

    out = []
    for name, k, n in GEMM_SHAPES:
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16) * k**-0.5
        for m in GEMM_ROWS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            us_default = do_bench(lambda: F.linear(x, w)) * 1e3  # noqa: B023
            us_det = do_bench(lambda: matmul(x, w)) * 1e3  # noqa: B023
            print(f"gemm {name} [{m} x {k}] -> {n}: default {us_default:.1f} us, "
                  f"deterministic {us_det:.1f} us (x{us_det / us_default:.2f})", flush=True)  # fmt: skip
            out.append({"gemm": name, "rows": m, "in": k, "out": n, "default_us": us_default,
                        "deterministic_us": us_det, "ratio": us_det / us_default})  # fmt: skip
    return out


def attention_runs() -> list[dict]:
    """The attention kernels alone, bf16, at Llama-3.1-8B's heads (32 / 8, head_dim 128) and
    the default model's (9 / 3, 64): the deterministic chunked_attention, planned as a CUDA
    graph plans it (for an 8192-token max_model_len), against the default mode's decode (split
    chosen per batch) or varlen kernel. us per call by triton's do_bench (median)."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [
        attention_case(heads, kv_heads, dim, batch, ctx, t, sms)
        for heads, kv_heads, dim in [(32, 8, 128), (9, 3, 64)]
        for batch, ctx, t in ATTENTION_CASES
    ]


def attention_case(
    heads: int, kv_heads: int, dim: int, batch: int, ctx: int, t: int, sms: int
) -> dict:
    import torch
    from triton.testing import do_bench

    from outrider.layers.attn_backends.triton_chunked import (
        ChunkWorkspace,
        chunked_attention,
        plan_chunks,
    )
    from outrider.layers.attn_backends.triton_decode import (
        SplitWorkspace,
        choose_num_splits,
        decode_attention,
    )
    from outrider.layers.attn_backends.triton_prefill import MAX_SPLIT_QUERY_LEN, prefill_attention

    dev, bf16, block_size = torch.device("cuda"), torch.bfloat16, 16
    pages = ctx // block_size
    k = torch.randn(batch * pages + 1, block_size, kv_heads, dim, device=dev).to(bf16)
    v = torch.randn_like(k)
    tables = (torch.randperm(batch * pages, device=dev) + 1).view(batch, pages).int()
    q = torch.randn(batch * t, heads, dim, device=dev).to(bf16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    starts = (torch.arange(batch + 1, device=dev) * t).int()
    scale = dim**-0.5
    # As TritonBackend chooses in the default mode (the varlen kernel's tiles taken as 16).
    programs = batch * kv_heads * (1 if t == 1 else -(-t // 16))
    splits = 1 if t > MAX_SPLIT_QUERY_LEN else choose_num_splits(programs, ctx, sms)
    split_ws = SplitWorkspace.allocate(batch * t, heads, splits, dim, dev) if splits > 1 else None
    plan = plan_chunks([t] * batch, 8192, heads, kv_heads, dim, bf16, sms)
    chunk_ws = ChunkWorkspace.allocate(plan, heads, dim, dev)

    def default():
        if t == 1:
            return decode_attention(q, k, v, tables, seq_lens, scale, splits, split_ws)
        return prefill_attention(
            q, k, v, tables, seq_lens, starts, t, scale, splits, None, split_ws
        )

    def chunked():
        return chunked_attention(q, k, v, tables, seq_lens, starts, plan, scale, chunk_ws)

    diff = (chunked().float() - default().float()).abs().max().item()
    us_default, us_det = do_bench(default) * 1e3, do_bench(chunked) * 1e3
    print(f"attention {heads}/{kv_heads} d{dim} B{batch} ctx{ctx} t{t}: default "
          f"{us_default:.1f} us, deterministic {us_det:.1f} us "
          f"(x{us_det / us_default:.2f})", flush=True)  # fmt: skip
    return {
        "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "batch": batch, "context": ctx,
        "query_tokens": t, "default_us": us_default, "deterministic_us": us_det,
        "ratio": us_det / us_default, "launches": len(plan.launches),
        "programs": plan.launches[0].programs, "max_abs_diff": diff,
    }  # fmt: skip


def llama8b_runs(args) -> dict:
    """Decode tok/s of the Llama-3.1-8B shape, plain and n-gram, in both modes (one engine at a
    time: four 16 GB models do not share a card), from 128-token random prompts."""
    import torch
    from gpu_decode import LLAMA_8B, random_checkpoint

    from outrider import SamplingParams
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    out: dict = {}
    max_c = max(args.concurrency)
    for mode in MODES:
        for cfg in ("plain", "ngram"):
            spec = engine_specs(args.k, None)[cfg] or {}
            config = EngineConfig().replace(
                model={"dtype": "bfloat16", "device": "cuda", "max_model_len": 4096,
                       "cuda_graph_max_batch": max_c, "deterministic": mode == "deterministic"},
                cache={"gpu_memory_utilization": 0.85, "enable_prefix_caching": False},
                scheduler={"max_num_seqs": max_c, "max_num_batched_tokens": 8192},
                speculative=spec,
            )  # fmt: skip
            engine = EngineCore(config, random_checkpoint(LLAMA_8B))
            for c in args.concurrency:
                g = torch.Generator().manual_seed(c)
                params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
                reqs = [
                    engine.add_request(
                        torch.randint(0, 128256, (128,), generator=g).tolist(), params
                    )
                    for _ in range(c)
                ]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                torch.cuda.synchronize()  # CPU-GPU sync point: the timed part ends here
                seconds = time.perf_counter() - t0
                tokens = sum(len(r.output_token_ids) for r in reqs)
                out.setdefault(f"c{c}", {}).setdefault(mode, {})[cfg] = {
                    "tok_per_s": round(tokens / seconds, 2),
                    "ids": [list(r.output_token_ids) for r in reqs],
                }
                print(
                    f"8B C={c:<3d} {mode:14s} {cfg:6s} {tokens / seconds:>9.1f} tok/s", flush=True
                )
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    for row in out.values():
        for mode_rows in row.values():
            plain = mode_rows["plain"]
            for r in mode_rows.values():
                r["speedup"] = round(r["tok_per_s"] / plain["tok_per_s"], 3)
                r["identical"] = f"{identical(r['ids'], plain['ids'])}/{len(plain['ids'])}"
        for mode_rows in row.values():
            for r in mode_rows.values():
                r.pop("ids")
    return {"runs": out, "cost": cost_table(out, args.concurrency)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=30, help="held-out prompts (at most 48)")
    ap.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
        help="speculative configs beside plain (default model)",
    )  # fmt: skip
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per (mode, config, C)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 drafter dir (default: the shipped one)")
    ap.add_argument("--llama8b", action="store_true", help="also the Llama-3.1-8B shape")
    ap.add_argument("--skip-default", action="store_true", help="only the Llama-3.1-8B shape")
    ap.add_argument(
        "--attention-only", action="store_true",
        help="only the kernels (attention and GEMMs): deterministic against the default mode's",
    )  # fmt: skip
    ap.add_argument(
        "--profile", type=int, nargs="*", default=None, metavar="C",
        help="also profile plain and EAGLE-3, both modes, at these C (kernel_profiles)",
    )  # fmt: skip
    ap.add_argument(
        "--skip-kernels", action="store_true",
        help="skip the attention and GEMM kernels alone (attention_runs, gemm_runs)",
    )  # fmt: skip
    ap.add_argument("--out", default="deterministic", help="result name")
    ap.add_argument("--out-dir", default=None, help="directory for the JSON (e.g. $OUT)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: use 1 or more")
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/deterministic.py measures CUDA kernels: run it on a GPU machine")
    result: dict = {"concurrency": args.concurrency, "new_tokens": args.new_tokens,
                    "k": args.k, "rounds": args.rounds}  # fmt: skip
    if not args.skip_kernels:
        result["attention"] = attention_runs()
        result["gemm"] = gemm_runs()
    if not args.skip_default and not args.attention_only:
        result["default_model"] = default_model_runs(args)
    if (args.llama8b or args.skip_default) and not args.attention_only:
        result["llama8b"] = llama8b_runs(args)
    path = write_result(args.out, result, args.out_dir)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
