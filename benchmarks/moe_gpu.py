"""DeepSeek-V3-family decode on one GPU: tokens per second, share of the bandwidth roofline
and kernels per step, for the Moonlight-16B-A3B shape (bf16 experts) and the Kimi-K2.5 shape
(its first layers, INT4 experts), with random weights made on the device.

    python benchmarks/moe_gpu.py [--model moonlight-16b-a3b kimi-k2.5] [--kimi-layers 4]
                                 [--concurrency 1 4 16 64] [--new-tokens 64] [--sync]
                                 [--synthetic-curves 0.55,0.75,0.91] [--hf] [--out-dir DIR]
    python benchmarks/moe_gpu.py --smoke --out-dir /tmp/moe   # tiny, CPU, seconds

Decode is measured as the engine runs it (EngineCore.step, CUDA graphs where the model
allows them), after an untimed prefill of --prompt-len random tokens per sequence.

The roofline of a step is the bytes it must read over the device's copy bandwidth measured in
the same run: every weight outside the routed experts once (the embedding: its C rows), the
routed experts a step of T tokens touches, E(1 - (1 - top_k / E)^T) per MoE layer (uniform
routing, which random weights give), and each sequence's cached latents at the mean context.

A profiled stretch of decode steps at each --profile-concurrency gives kernels per step (graph
replays counted kernel by kernel), GPU busy time against the step's wall time, and the kernels
of one step by name.

Then the planner against the family (`plan`): each MoE shape's decode and verify steps (k in
--plan-ks, batches in --plan-batches, as `outrider plan --calibrate` times them: the model
runner's graphs, context 0) measured in turns with the Llama-3.1-8B shape's, the planner's
machine constants fitted to the dense model's points (`outrider plan --calibrate`) and used to
predict the MoE shape's (`cross_error`; goal within 25%), and each verify step over the plain
step at its batch (`verify_over_plain`). --plan-batches with no value skips it.

Then speculation on each shape (`synthetic`, benchmarks/synthetic_accept.py): an EAGLE-3
drafter of the target's shape inside every step, drafts corrupted to --synthetic-curves
(accept lengths about 2.0, 2.7 and 3.5 at k=3), at each --synthetic-concurrency, with k fixed
and with the adaptive controller: accept length against the curve's, speedup over plain.
--hf adds HF transformers' decode at C=1 on the same shape (bf16 experts only). --sync measures
decode again with async scheduling off (it is on by default on CUDA).

Writes moe_gpu.json (--smoke: moe_gpu_smoke.json) under benchmarks/results or --out-dir, and a
PNG beside it: tok/s and share of the roofline against C.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import idle_per_step, kernel_spans, pyplot, save_figure, write_result  # noqa: E402
from gpu_decode import LLAMA_8B, copy_bandwidth_gbs, run_outrider  # noqa: E402
from kimi_layers import KIMI, hf_config, random_checkpoint  # noqa: E402
from plan_accuracy import compare, measure_interleaved  # noqa: E402

# moonshotai/Moonlight-16B-A3B's config.json (DeepSeek-V3 architecture, no q LoRA).
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.446, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163585,
}  # fmt: skip
# A tiny model of the family for --smoke: two expert groups, a shared expert, no q LoRA.
SMOKE = {
    **MOONLIGHT, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
}  # fmt: skip
# The dense model the planner is fitted on in --smoke: the Llama family, tiny.
SMOKE_DENSE = {
    **LLAMA_8B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
PLAN_GOAL = 0.25  # |cross_error| of every MoE point


def model_config(name: str, kimi_layers: int) -> dict:
    if name == "moonlight-16b-a3b":
        return MOONLIGHT
    if name == "kimi-k2.5":
        return hf_config(KIMI, kimi_layers, 1)
    raise ValueError(f"unknown --model {name!r}: use moonlight-16b-a3b or kimi-k2.5")


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens route to, each choosing top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def step_bytes(model, hf: dict, concurrency: int, context: float, kv_bytes: int) -> float:
    """Bytes a decode step of `concurrency` sequences at mean `context` must read."""
    experts = hf["n_routed_experts"]
    per_expert = other = 0
    stacked = experts  # experts a layer's stack holds: the routed, then any shared held there
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts." in name:  # stacked [E (+ shared), ...]: one layer's
            per_expert += size / p.shape[0]
            stacked = p.shape[0]
        elif "embed_tokens" in name:
            other += size * concurrency / p.shape[0]
        else:
            other += size
    moe_layers = hf["num_hidden_layers"] - hf["first_k_dense_replace"]
    per_expert /= max(moe_layers, 1)
    touched = expected_experts(experts, hf["num_experts_per_tok"], concurrency)
    touched += stacked - experts  # shared experts in the stack: read every step
    latent = (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * kv_bytes * hf["num_hidden_layers"]
    return other + moe_layers * touched * per_expert + concurrency * context * latent


def profile_decode(engine, concurrency: int, prompt_len: int, steps: int, device: str) -> dict:
    """Kernels per decode step, GPU busy against wall, one step's kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    from outrider.executor.step_timing import kernel_times

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    row = run_outrider(engine, concurrency, prompt_len, steps + 1, during=prof)
    kernels = kernel_times(prof)
    n = row["steps"]
    spans = kernel_spans(prof)
    by_name = Counter(name for name, _ in kernels)
    us_by_name: Counter = Counter()
    for name, us in kernels:
        us_by_name[name] += us
    return {
        "steps": n,
        "kernels_per_step": round(len(kernels) / n, 1),
        "busy_ms_per_step": round(sum(us for _, us in kernels) / 1e3 / n, 3),
        "wall_ms_per_step": round(row["step_ms"], 3),  # profiled: slower than unprofiled
        **idle_per_step(spans, n),
        # name -> [launches, microseconds] per step, costliest first
        "by_name_per_step": {
            k[:90]: [round(by_name[k] / n, 2), round(us / n, 1)]
            for k, us in us_by_name.most_common()
        },
    }


def build_engine(
    hf: dict, device: str, dtype: torch.dtype, max_c: int, max_len: int, overlap: bool | None = None
):
    """An EngineCore on random weights of `hf`'s shape, CUDA graphs up to max_c sequences;
    overlap: async scheduling (the next plain decode launched before this one's tokens are
    read; None: the engine's default, on for CUDA)."""
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    config = EngineConfig().replace(
        model={"dtype": str(dtype).removeprefix("torch."), "device": device,
               "max_model_len": max_len, "cuda_graph_max_batch": max_c},
        cache={"gpu_memory_utilization": 0.85, "enable_prefix_caching": False},
        scheduler={"max_num_seqs": max_c, "max_num_batched_tokens": 8192,
                   "async_scheduling": overlap},
    )  # fmt: skip
    if device == "cpu":
        config = config.replace(cache={"num_blocks": 64})
    return EngineCore(config, random_checkpoint(hf, device, dtype))


def kernels_per_decode_step(hf: dict, concurrency: int = 1) -> float:
    """Kernels a graph-replayed bf16 decode step of `hf`'s shape launches on CUDA."""
    engine = build_engine(hf, "cuda", torch.bfloat16, concurrency, 256)
    try:
        return profile_decode(engine, concurrency, 16, 8, "cuda")["kernels_per_step"]
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def measure(
    name: str, hf: dict, args, device: str, dtype: torch.dtype, bandwidth: float,
    overlap: bool | None = None,
) -> dict:  # fmt: skip
    """Decode at each --concurrency and the profiled stretches; overlap: async scheduling
    (None: the engine's default, on for CUDA)."""
    t0 = time.perf_counter()
    engine = build_engine(hf, device, dtype, max(args.concurrency), args.max_model_len, overlap)
    build_s = time.perf_counter() - t0
    model = engine.runner.model
    kv_bytes = dtype.itemsize
    context = args.prompt_len + args.new_tokens / 2
    rows = {}
    for c in args.concurrency:
        r = run_outrider(engine, c, args.prompt_len, args.new_tokens)
        need = step_bytes(model, hf, c, context, kv_bytes)
        roof = c * bandwidth * 1e9 / need if bandwidth else None
        rows[str(c)] = {
            "tok_per_s": round(r["tok_per_s"], 1),
            "step_ms": round(r["step_ms"], 3),
            "step_bytes_gb": round(need / 1e9, 3),
            "roofline_tok_per_s": round(roof, 1) if roof else None,
            "share_of_roofline": round(r["tok_per_s"] / roof, 3) if roof else None,
        }
        print(f"{name}{' sync' if overlap is False else ''} C={c}: {rows[str(c)]}", flush=True)
    profiles = {}
    for c in args.profile_concurrency:
        profiles[str(c)] = profile_decode(engine, c, args.prompt_len, 8, device)
        p = profiles[str(c)]
        print(f"{name}{' sync' if overlap is False else ''} C={c} profiled: {p['kernels_per_step']} "
              f"kernels a step, busy {p['busy_ms_per_step']} ms, gaps "
              f"{p['launch_gaps_ms_per_step']} (launch) + {p['host_gaps_ms_per_step']} (host) "
              f"ms", flush=True)  # fmt: skip
    result = {
        "config": {k: v for k, v in hf.items() if k != "quantization_config"},
        "int4_experts": hf.get("quantization_config") is not None,
        "layers": hf["num_hidden_layers"],
        "cuda_graphs": engine.runner.graphs is not None,
        "build_s": round(build_s, 1),
        "decode": rows,
        "profile": profiles,
    }
    del engine, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def plan_check(name: str, hf: dict, args, device: str, dtype: torch.dtype) -> dict:
    """The planner fitted on the dense Llama shape's steps predicts `hf`'s decode and verify
    steps, both measured in turns in this process (benchmarks/plan_accuracy.py)."""
    from outrider.plan import calibrate

    dense = ("llama-3.1-8b", LLAMA_8B) if device == "cuda" else ("dense", SMOKE_DENSE)
    cuda = device == "cuda"
    shapes = {  # KV budget: each runner's share of the device less what is already in use
        dense[0]: (dense[1], False, 0.25 if cuda else None),
        name: (hf, False, 0.9 if cuda else None),
    }  # fmt: skip
    measured = measure_interleaved(
        tuple(args.plan_batches), (0, *args.plan_ks), args.plan_reps, shapes, device,
        str(dtype).removeprefix("torch."), makers={name: lambda: random_checkpoint(hf, device, dtype)},
    )  # fmt: skip
    if cuda:
        from outrider.plan.cli import _gpu_by_name

        prior = _gpu_by_name(torch.cuda.get_device_name())
    else:
        m = measured[name]
        prior = calibrate.cpu_profile(m.threads, m.memory_gb)
    graphs = measured[name].graphs
    models = {n: m.model for n, m in measured.items()}
    points = {n: m.points for n, m in measured.items()}
    result = compare(models, points, prior, graphs)
    rows = [r for r in result["rows"] if r["model"] == name]
    plain = {r["batch"]: r["measured_ms"] for r in rows if r["k"] == 0}
    worst = max(abs(r["cross_error"]) for r in rows)
    for r in rows:
        print(f"{name} plan B={r['batch']} k={r['k']}: measured {r['measured_ms']:.3f} ms, "
              f"fitted on {dense[0]} {r['cross_ms']:.3f} ({r['cross_error']:+.1%})", flush=True)  # fmt: skip
    return {
        "fitted_on": dense[0],
        "fitted": result["fitted_on"][dense[0]],
        "rows": rows,
        "verify_over_plain": {
            str(b): {
                str(r["k"]): round(r["measured_ms"] / plain[b], 3)
                for r in rows
                if r["batch"] == b and r["k"]
            }
            for b in sorted(plain)
        },  # fmt: skip
        "worst_cross_error": worst,
        "goal": f"|cross_error| <= {PLAN_GOAL} at every point of the MoE shape",
        "holds": worst <= PLAN_GOAL,
    }


# Acceptance curves whose accept lengths at k=3 are about 2.0, 2.7 and 3.5 (the range published
# Kimi-K2.5 EAGLE-3 drafters reach: 2.7 on MT-Bench to 3.8 on tool calls).
SYNTHETIC_CURVES = "0.55,0.75,0.91"


def synthetic(name: str, args, device: str, controller: str) -> dict:
    """benchmarks/synthetic_accept.py on this shape: plain decode, then speculation at each
    --synthetic-curves curve with an EAGLE-3 drafter of the target's shape inside every step,
    at each --synthetic-concurrency, `controller` choosing the drafts ("fixed": k every step;
    "adaptive": the engine's controller). Per curve and C: accept length against the curve's,
    speedup over plain, the planner's speedup at the measured accept length."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # (a test's loader leaves sys.path as it was)
        sys.path.insert(0, here)
    import synthetic_accept  # here, not above: it imports this module's shapes

    smoke = device == "cpu"
    ns = argparse.Namespace(
        model="moe-tiny" if smoke else name, curves=args.synthetic_curves, k=args.synthetic_k,
        concurrency=args.synthetic_concurrency, prompt_len=16 if smoke else args.prompt_len,
        new_tokens=24 if smoke else args.synthetic_tokens, draft_vocab=32000, device=device,
        dtype="float32" if smoke else "bfloat16", gpu=None, seed=0, tensor_parallel_size=1,
        link="nvlink4", out_dir=None, smoke=False, controller=controller,
        kimi_layers=args.kimi_layers,
    )  # fmt: skip
    payload = synthetic_accept.run(ns)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    keep = ("accept_length", "target_accept_length", "speedup", "tok_per_s", "plain_tok_per_s",
            "predicted_speedup_at_measured", "lossless")  # fmt: skip
    rows = {}
    for r in payload["rows"]:
        curve = "/".join(map(str, r["curve"]))
        rows.setdefault(curve, {})[str(r["concurrency"])] = {k: r[k] for k in keep}
    return {"controller": controller, "k": ns.k, "new_tokens": ns.new_tokens, "curves": rows}


def run_hf(hf: dict, prompt_len: int, new_tokens: int) -> dict:
    """HF transformers' DeepseekV3ForCausalLM of `hf`'s shape, bf16 on CUDA with its own random
    weights (a step's time does not depend on them), greedy `generate` at one stream: decode
    tok/s as the difference of a long and a one-token generate (the prefill cancels)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**hf)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, hf["vocab_size"], (1, prompt_len), device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def timed(model, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()  # CPU-GPU sync point: the timed region ends on the device
        return time.perf_counter() - t0

    with torch.inference_mode():
        timed(model, 4)  # warm-up
        full, one = timed(model, new_tokens), timed(model, 1)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "transformers": transformers.__version__,
        "tok_per_s": round((new_tokens - 1) / (full - one), 1),
        "new_tokens": new_tokens,
    }


def plot(results: dict, path: Path) -> None:
    """tok/s and share of the roofline against C, one line per model and scheduling mode."""
    plt = pyplot()
    if plt is None:
        return
    fig, (tps, share) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in results.items():
        for label, rows in (
            (name, run["decode"]),
            (f"{name} sync", run.get("sync", {}).get("decode")),
        ):
            if not rows:
                continue
            cs = sorted(rows, key=int)
            tps.plot(
                [int(c) for c in cs], [rows[c]["tok_per_s"] for c in cs], marker="o", label=label
            )
            if rows[cs[0]].get("share_of_roofline") is not None:
                share.plot([int(c) for c in cs], [rows[c]["share_of_roofline"] for c in cs],
                           marker="o", label=label)  # fmt: skip
    for ax, ylabel in ((tps, "decode tokens/s"), (share, "share of the copy-bandwidth roofline")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency (sequences a step)", ylabel=ylabel)
        if ax.lines:  # (no roofline without a measured bandwidth: the CPU)
            ax.legend(fontsize=8)
    share.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    share.axhline(0.8, color="grey", linestyle=":", linewidth=1)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", nargs="+", default=["moonlight-16b-a3b", "kimi-k2.5"])
    ap.add_argument(
        "--kimi-layers", type=int, default=4, help="Kimi-K2.5 layers to build (1 dense, then MoE)"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--profile-concurrency", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--max-model-len", type=int, default=4096, help="as a server is started (attention splits)"
    )
    ap.add_argument("--plan-batches", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--plan-ks", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--plan-reps", type=int, default=10)
    ap.add_argument(
        "--sync", action="store_true",
        help="measure decode again with async scheduling off (under each model's 'sync')",
    )  # fmt: skip
    ap.add_argument(
        "--synthetic-curves",
        default=SYNTHETIC_CURVES,
        help="speculation at these acceptance curves (synthetic_accept.py); '' skips",
    )
    ap.add_argument("--synthetic-concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--synthetic-k", type=int, default=3)
    ap.add_argument("--synthetic-tokens", type=int, default=128)
    ap.add_argument(
        "--hf",
        action="store_true",
        help="HF transformers' decode at C=1 beside (bf16 experts only)",
    )
    ap.add_argument("--out-dir", default=None, help="where moe_gpu.json goes")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU in fp32")
    args = ap.parse_args()
    if args.smoke:
        device, dtype, bandwidth = "cpu", torch.float32, 0.0
        models = {"smoke": SMOKE}
        args.concurrency, args.profile_concurrency = [1, 2], [1]
        args.prompt_len, args.new_tokens, args.max_model_len = 8, 4, 64
        args.plan_batches, args.plan_ks, args.plan_reps = [1, 2], [1], 1
        args.synthetic_curves, args.synthetic_concurrency = "1.0,0.5", [1, 2]
    else:
        device, dtype = "cuda", torch.bfloat16
        bandwidth = copy_bandwidth_gbs()
        models = {m: model_config(m, args.kimi_layers) for m in args.model}
    results = {}
    for name, hf in models.items():
        results[name] = measure(name, hf, args, device, dtype, bandwidth)
        if args.sync:
            results[name]["sync"] = measure(name, hf, args, device, dtype, bandwidth, False)
        if args.plan_batches:
            results[name]["plan"] = plan_check(name, hf, args, device, dtype)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        if args.synthetic_curves:
            results[name]["synthetic"] = {
                c: synthetic(name, args, device, c) for c in ("fixed", "adaptive")
            }
        if args.hf and device == "cuda":
            if hf.get("quantization_config") is None:
                try:  # a failure here keeps the engine's figures above
                    results[name]["hf"] = run_hf(hf, args.prompt_len, args.new_tokens)
                except Exception as e:  # noqa: BLE001
                    results[name]["hf"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{name} HF transformers C=1: {results[name]['hf']}", flush=True)
            else:
                results[name]["hf"] = {"skipped": "INT4 (compressed-tensors) experts"}
    path = write_result(
        "moe_gpu_smoke" if args.smoke else "moe_gpu",
        {"device": device, "dtype": str(dtype), "copy_bandwidth_gbs": round(bandwidth, 1),
         "models": results},
        args.out_dir,
    )  # fmt: skip
    print(f"wrote {path}")
    plot(results, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
