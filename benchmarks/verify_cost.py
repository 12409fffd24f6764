"""What verifying k drafts costs: forward time for 1 + k tokens per sequence on a 1024-token
context, outrider's CUDA graphs vs HF transformers with a static cache (eager), one run.

    python benchmarks/verify_cost.py [--ks 0 1 3 7 15 31 63] [--batches 1 16] [--context 1024]

Llama-3.1-8B shape, random bf16 weights on the GPU. Goal at C=1: T(1+7) <= 1.15 x T(1).
Writes benchmarks/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from gpu_decode import LLAMA_8B, random_checkpoint  # noqa: E402


def cuda_time_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def outrider_times(ks, batches, context) -> dict:
    from outrider.config import EngineConfig
    from outrider.core import ForwardMode
    from outrider.engine.engine import EngineCore
    from outrider.executor.cuda_graph import GraphKey, GraphRunner

    config = EngineConfig().replace(
        model={"dtype": "bfloat16", "device": "cuda", "max_model_len": 4096, "cuda_graphs": False},
        cache={"gpu_memory_utilization": 0.5, "enable_prefix_caching": False},
    )
    engine = EngineCore(config, random_checkpoint(LLAMA_8B))
    runner = engine.runner
    bs = runner.block_size
    graphs = GraphRunner(
        runner.model, runner.backend, max_blocks=4096 // bs, scratch_block=runner.num_blocks,
        block_size=bs, batch_sizes=tuple(batches), tokens_per_seq=tuple(1 + k for k in ks),
    )  # fmt: skip
    graphs.capture()
    s = graphs.inputs
    out = {}
    for b in batches:
        for k in ks:
            t = 1 + k
            ctx = context + t
            per_seq = -(-ctx // bs)
            tables = torch.arange(b * per_seq, dtype=torch.int32, device="cuda").view(b, per_seq)
            s.block_tables[:b].fill_(graphs.scratch_block)
            s.block_tables[:b, :per_seq].copy_(tables)
            s.seq_lens[:b].fill_(ctx)
            s.query_start_loc[: b + 1].copy_(torch.arange(b + 1, device="cuda") * t)
            pos = torch.arange(context, ctx, device="cuda").repeat(b)
            s.positions[: b * t].copy_(pos)
            rows = torch.arange(b, device="cuda").repeat_interleave(t)
            slot = tables.long()[rows, pos // bs] * bs + pos % bs
            s.slot_mapping[: b * t].copy_(slot)
            mode = ForwardMode.DECODE if t == 1 else ForwardMode.VERIFY
            graph = graphs.graphs[GraphKey(mode, b, t)][0]
            out[f"C{b}_k{k}"] = round(cuda_time_ms(graph.replay), 3)
            print(f"outrider graphs C={b} k={k}: {out[f'C{b}_k{k}']} ms", flush=True)
    del engine, graphs, runner
    torch.cuda.empty_cache()
    return out


def _rewind(cache, length: int) -> None:
    """Put a static cache back to `length` tokens so every timed step writes the same slots.

    Newer transformers keep a per-layer write offset (`cumulative_length`) that ignores
    cache_position; older ones index by cache_position alone and need nothing."""
    for layer in getattr(cache, "layers", ()):
        offset = getattr(layer, "cumulative_length", None)
        if isinstance(offset, torch.Tensor):
            offset.fill_(length)
        elif isinstance(offset, int):
            layer.cumulative_length = length


def hf_times(ks, batches, context) -> dict:
    import transformers

    cfg = transformers.AutoConfig.for_model(**LLAMA_8B)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    out = {}
    for b in batches:
        cache = transformers.StaticCache(config=cfg, max_cache_len=context + 128)
        with torch.inference_mode():
            ids = torch.randint(0, cfg.vocab_size, (b, context), device="cuda")
            model(ids, past_key_values=cache, cache_position=torch.arange(context, device="cuda"))
            for k in ks:
                t = 1 + k
                x = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
                pos = torch.arange(context, context + t, device="cuda")

                def step(x=x, pos=pos, cache=cache, t=t):
                    _rewind(cache, context)
                    model(x, past_key_values=cache, cache_position=pos, logits_to_keep=t)

                out[f"C{b}_k{k}"] = round(cuda_time_ms(step, reps=10), 3)
                print(f"HF static (eager) C={b} k={k}: {out[f'C{b}_k{k}']} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7, 15, 31, 63])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    ours = outrider_times(args.ks, args.batches, args.context)
    result = {"context": args.context, "outrider_graph_ms": ours}
    if 0 in args.ks and 7 in args.ks and 1 in args.batches:
        result["ratio_c1_k7_over_k0"] = round(ours["C1_k7"] / ours["C1_k0"], 3)
        print(f"T(1+7) / T(1) at C=1: {result['ratio_c1_k7_over_k0']} (goal <= 1.15)")
    if not args.skip_hf:
        try:
            result["hf_static_eager_ms"] = hf_times(args.ks, args.batches, args.context)
        except Exception as e:  # report it; keep our numbers
            result["hf_static_eager_ms"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(result["hf_static_eager_ms"])
    print(f"wrote {write_result('verify_cost', result)}")


if __name__ == "__main__":
    main()
