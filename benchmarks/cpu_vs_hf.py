"""outrider vs HF transformers `generate` on the default model, on this machine's CPU, in one run.

    python benchmarks/cpu_vs_hf.py [--dtypes float32 bfloat16] [--new-tokens 128] [--batch 16]

Batch 1 (one prompt, 128 new tokens) and a batch of 16 prompts (128 new tokens each), greedy,
EOS ignored so both engines produce exactly the same number of tokens. Writes
benchmarks/results/cpu_vs_hf.json and prints a table plus outrider's step profile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot learning to paint.",
    "Explain how a refrigerator works.",
    "Give me three tips for staying focused while studying at home.",
    "What are the main differences between Python and JavaScript?",
    "Describe the water cycle.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why do leaves change color in autumn?",
    "How do I make a cup of tea?",
    "What is machine learning?",
    "Write a poem about the moon.",
    "List five healthy breakfast ideas.",
    "Explain the rules of chess briefly.",
    "What causes earthquakes?",
    "How does the internet work?",
    "Tell me a fun fact about octopuses.",
]


def run_outrider(dtype: str, prompts: list[list[int]], new_tokens: int) -> dict:
    from outrider import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "seconds": dt, "tok_per_s": n / dt, "first": outs[0].token_ids}


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id
    )
    with torch.inference_mode():
        model.generate(
            ids[:1, -8:],
            attention_mask=mask[:1, -8:],
            **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4},
        )
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - width) * len(prompts)
    return {
        "tokens": n,
        "seconds": dt,
        "tok_per_s": n / dt,
        "first": out[0, width : width + 16].tolist(),
    }


def _same_until_eos(ours: list[int], ref: list[int], eos: set[int]) -> bool:
    n = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:n] == ref[:n]


def profile_outrider(dtype: str, prompts: list[list[int]]) -> str:
    """Top operators of 16 decode steps at the given batch: where outrider's time goes."""
    from outrider import LLM, SamplingParams

    llm = LLM(dtype=dtype, device="cpu", enable_prefix_caching=False)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from outrider.loaders.checkpoint import open_checkpoint

    ckpt = open_checkpoint(None)
    tok = ckpt.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    prompts = [tok.encode(c, add_special_tokens=False) for c in chats]
    batch = (prompts * ((args.batch + len(prompts) - 1) // len(prompts)))[: args.batch]
    eos = set(tok.eos_token_ids)
    results = []
    profiles = {}
    for dtype in args.dtypes:
        hf = AutoModelForCausalLM.from_pretrained(
            str(ckpt.path.parent), gguf_file=ckpt.path.name, dtype=getattr(torch, dtype)
        ).eval()
        for name, ps in (("batch1", batch[:1]), (f"batch{args.batch}", batch)):
            ours = run_outrider(dtype, ps, args.new_tokens)
            ref = run_hf(hf, ps, args.new_tokens, tok.eos_token_ids[0])
            row = {
                "dtype": dtype,
                "case": name,
                "batch": len(ps),
                "new_tokens": args.new_tokens,
                "outrider_tok_per_s": round(ours["tok_per_s"], 2),
                "hf_tok_per_s": round(ref["tok_per_s"], 2),
                "speedup": round(ours["tok_per_s"] / ref["tok_per_s"], 3),
                # Up to outrider's first EOS: there HF's min_new_tokens masks EOS while
                # ignore_eos does not, so the continuations legitimately differ.
                "same_tokens_until_eos": _same_until_eos(ours["first"], ref["first"], eos),
            }
            results.append(row)
            print(row, flush=True)
        del hf
        if not args.no_profile:
            profiles[dtype] = profile_outrider(dtype, batch)
            print(profiles[dtype])
    path = write_result("cpu_vs_hf", {"results": results, "outrider_profile_batch": profiles})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
