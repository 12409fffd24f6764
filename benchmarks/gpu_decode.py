"""Decode throughput on a GPU: outrider vs HF transformers (static cache + torch.compile), and
how close batch-1 decoding gets to the memory-bandwidth roofline.

    python benchmarks/gpu_decode.py [--concurrency 1 8 32 64] [--prompt-len 128] [--new-tokens 256]
                                    [--skip-hf] [--skip-default] [--profile]
                                    [--hf-concurrency 1 32]

The Llama-3.1-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256)
with random bf16 weights built on the GPU: speed does not depend on weight values. Roofline at
C=1: bytes read per step (weights + KV) / device copy bandwidth measured in the same run;
`roofline_tok_per_s_c32` is the same bound at C=32 (beside HF's C=32 figure it says what any
engine could reach over HF). `--profile` adds `step_breakdown_c1`: a C=1 step's milliseconds in
weight GEMMs, attention, other kernels and idle GPU, kernels per step, the costliest others.
Writes benchmarks/results/gpu_decode.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

# The embedded default model's shape (SmolLM2-135M-Instruct): random weights of it time as its
# own do, with no 98 MB checkpoint to carry to a GPU.
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)  # fmt: skip


class _NullTokenizer:
    """Random weights need no text: decode nothing, stop only at max_tokens."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def copy_bandwidth_gbs() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    return 2 * x.numel() / dt / 1e9  # bytes read + written


def random_checkpoint(
    hf_config: dict,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
    residual_write_scale: float = 1.0,
    tied_head: bool = False,
):
    """Random weights of `hf_config`'s Llama shape, made on `device` (time does not depend on
    the values): norms 1, the rest N(0, std), the layers' writes into the residual stream
    (o_proj, down_proj) `residual_write_scale` times that; `tied_head`: the LM head's rows are
    the embedding's (its own tensor still, read at full size)."""
    from outrider.loaders.checkpoint import Checkpoint
    from outrider.loaders.hf_config import TransformerConfig

    cfg = TransformerConfig.from_hf_dict(hf_config)

    class _Random:
        def iter_tensors(self):
            # Shapes from an HF model skeleton on the meta device.
            import transformers

            meta_cfg = transformers.AutoConfig.for_model(**hf_config)
            with torch.device("meta"):
                skeleton = transformers.LlamaForCausalLM(meta_cfg)
            g = torch.Generator(device=device).manual_seed(0)
            embedding = None
            for name, p in skeleton.state_dict().items():
                if "norm" in name:
                    yield name, torch.ones(p.shape, device=device, dtype=dtype)
                    continue
                if name == "lm_head.weight" and tied_head:
                    yield name, embedding
                    continue
                scale = std
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    scale *= residual_write_scale
                w = torch.randn(p.shape, device=device, dtype=dtype, generator=g) * scale
                if name == "model.embed_tokens.weight":
                    embedding = w
                yield name, w

    return Checkpoint(Path("random"), "random", hf_config, cfg, _NullTokenizer(), _Random())


def run_outrider(engine, concurrency: int, prompt_len: int, new_tokens: int, during=None) -> dict:
    """Decode tok/s after an untimed prefill; `during`: a context (a profiler) around the
    decode steps only."""
    import contextlib

    from outrider import SamplingParams

    g = torch.Generator().manual_seed(concurrency)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [
        torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(concurrency)
    ]
    reqs = [engine.add_request(p, params) for p in prompts]
    # Prefill outside the timed region: this measures decoding.
    while any(len(r.output_token_ids) == 0 for r in reqs):
        engine.step()
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else lambda: None
    sync()
    with during if during is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        sync()
        dt = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
    return {"tok_per_s": tokens / dt, "step_ms": dt / steps * 1e3, "steps": steps}


def run_hf(concurrency: int, prompt_len: int, new_tokens: int) -> dict:
    import transformers

    cfg = transformers.AutoConfig.for_model(**LLAMA_8B)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    # generate() compiles its decoding forward itself when the cache is static (the documented
    # path; wrapping model.forward in torch.compile too breaks its CUDA graphs).
    compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    ids = torch.randint(0, cfg.vocab_size, (concurrency, prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(
        do_sample=False, cache_implementation="static", min_new_tokens=new_tokens,
        compile_config=compile_config, attention_mask=mask, pad_token_id=0,
    )  # fmt: skip
    with torch.inference_mode():
        for _ in range(2):  # compile and warm up
            model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        full = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **{**kwargs, "min_new_tokens": 1})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **{**kwargs, "min_new_tokens": 1})
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"tok_per_s": concurrency * (new_tokens - 1) / (full - prefill)}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-concurrency", type=int, nargs="+", default=None,
                    help="HF runs (each compiles for minutes; default: --concurrency)")  # fmt: skip
    ap.add_argument("--skip-default", action="store_true")
    ap.add_argument(
        "--profile", action="store_true", help="print a torch profiler table of a C=1 step"
    )
    ap.add_argument(
        "--compare-async",
        action="store_true",
        help="also time C=1 and C=32 with async scheduling off (on by default on CUDA), in "
        "the same run",
    )
    ap.add_argument(
        "--compare-unfused",
        action="store_true",
        help="also time C=1 with the fused norm/rotary/SiLU kernels off, in the same run",
    )
    args = ap.parse_args()

    from outrider import env
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    bandwidth = copy_bandwidth_gbs()
    max_c = max(args.concurrency)
    config = EngineConfig().replace(
        model={"dtype": "bfloat16", "device": "cuda", "max_model_len": 4096,
               "attention_backend": args.backend, "cuda_graph_max_batch": max_c},
        cache={"gpu_memory_utilization": 0.6, "enable_prefix_caching": False},
        scheduler={"max_num_seqs": max_c, "max_num_batched_tokens": 8192},
    )  # fmt: skip
    t0 = time.perf_counter()
    engine = EngineCore(config, random_checkpoint(LLAMA_8B))
    load_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    rows = {}
    for c in args.concurrency:
        rows[c] = run_outrider(engine, c, args.prompt_len, args.new_tokens)
        print(f"outrider 8B C={c}: {rows[c]}", flush=True)
    # Bytes per step at C=1: every weight once, plus the KV read at the mean context.
    cfg = engine.runner.model_config
    kv_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * cfg.num_hidden_layers
    mean_ctx = args.prompt_len + args.new_tokens / 2
    step_bytes = weight_bytes + kv_per_token * mean_ctx
    roofline = bandwidth * 1e9 / step_bytes
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_gbs": round(bandwidth, 1),
        "weight_bytes": weight_bytes,
        "roofline_tok_per_s_c1": round(roofline, 1),
        "pct_roofline_c1": round(100 * rows[min(args.concurrency)]["tok_per_s"] / roofline, 1)
        if 1 in rows
        else None,
        "attention_backend": engine.runner.backend.name,
        "fused_kernels": env.fused_kernels(),
        "cuda_graphs": engine.runner.graphs is not None,
        "engine_start_s": round(load_s, 1),
        "outrider_8b": {str(c): {k: round(v, 2) for k, v in r.items()} for c, r in rows.items()},
    }
    # The 5x HF goal at C=32 against what bandwidth allows there: weights once plus 32 KVs.
    roof32 = 32 * bandwidth * 1e9 / (weight_bytes + 32 * kv_per_token * mean_ctx)
    result["roofline_tok_per_s_c32"] = round(roof32, 1)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        from outrider.bench.step_profile import step_breakdown
        from outrider.executor.step_timing import kernel_times

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        row = run_outrider(engine, 1, args.prompt_len, 17, during=prof)
        if 1 in rows:  # kernel times from the profiled steps, the step from the timed run
            result["step_breakdown_c1"] = step_breakdown(
                kernel_times(prof), row["steps"], rows[1]["step_ms"], 1e3 / roofline
            )
            print(f"C=1 step: {result['step_breakdown_c1']}", flush=True)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        print(table)
        result["profile_c1"] = table
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(host)
        result["profile_c1_host"] = host
    del engine
    torch.cuda.empty_cache()
    if args.compare_async:
        sync = EngineCore(
            config.replace(scheduler={"async_scheduling": False}), random_checkpoint(LLAMA_8B)
        )
        result["outrider_8b_sync"] = {}
        for c in (1, 32):
            row = run_outrider(sync, c, args.prompt_len, args.new_tokens)
            result["outrider_8b_sync"][str(c)] = {k: round(v, 2) for k, v in row.items()}
            print(f"outrider 8B C={c} async scheduling off: {row}", flush=True)
        del sync
        torch.cuda.empty_cache()
    if args.compare_unfused:
        os.environ["OUTRIDER_FUSED_KERNELS"] = "0"
        unfused = EngineCore(config, random_checkpoint(LLAMA_8B))
        row = run_outrider(unfused, 1, args.prompt_len, args.new_tokens)
        result["outrider_8b_unfused_c1"] = {k: round(v, 2) for k, v in row.items()}
        print(f"outrider 8B C=1 unfused: {row}", flush=True)
        del unfused
        torch.cuda.empty_cache()
        os.environ.pop("OUTRIDER_FUSED_KERNELS")
    if not args.skip_hf:
        hf = {}
        for c in args.hf_concurrency or args.concurrency:
            try:
                hf[str(c)] = {
                    k: round(v, 2) for k, v in run_hf(c, args.prompt_len, args.new_tokens).items()
                }
            except Exception as e:  # report, don't lose the rest of the run
                hf[str(c)] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"HF static+compile C={c}: {hf[str(c)]}", flush=True)
        result["hf_static_compile_8b"] = hf
        if "32" in hf and "tok_per_s" in hf["32"] and "32" in result["outrider_8b"]:
            result["speedup_c32_vs_hf"] = round(
                result["outrider_8b"]["32"]["tok_per_s"] / hf["32"]["tok_per_s"], 2
            )
            # The most any engine could reach over HF here: the C=32 roofline.
            result["roofline_c32_vs_hf"] = round(roof32 / hf["32"]["tok_per_s"], 2)
    if not args.skip_default:
        default = EngineCore(EngineConfig().replace(
            model={"dtype": "bfloat16", "device": "cuda", "attention_backend": args.backend},
            cache={"gpu_memory_utilization": 0.3, "enable_prefix_caching": False},
            scheduler={"max_num_seqs": 64},
        ))  # fmt: skip
        result["default_model"] = {
            str(c): {
                k: round(v, 2)
                for k, v in run_outrider(default, c, args.prompt_len, args.new_tokens).items()
            }
            for c in (1, 64)
        }
        print(f"default model: {result['default_model']}", flush=True)
    path = write_result("gpu_decode", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
