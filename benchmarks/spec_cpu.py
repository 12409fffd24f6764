"""Plain vs n-gram speculative decoding on the default model on this CPU, with HF transformers'
prompt lookup decoding in the same run.

    python benchmarks/spec_cpu.py [--dtypes float32 bfloat16] [--prompts 4] [--new-tokens 96] [-k 4]

Batch 1, greedy, one prompt at a time, on input-grounded tasks and on open questions
(outrider/bench/datasets.py). Reports tok/s, accept length (tokens per verify per sequence,
bonus included) and tokens per forward; checks the speculative output equals the plain one.
Writes benchmarks/results/spec_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def run_outrider(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from outrider import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    tokens, seconds, outs = 0, 0.0, []
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outs.append(out)
    steps = sum(o.metrics["num_verify_steps"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    return {
        "tokens": tokens,
        "tok_per_s": tokens / seconds,
        "accept_length": None if not steps else round(1 + accepted / steps, 3),
        # Forwards: one prefill per prompt plus one per decode or verify step.
        "tokens_per_forward": round(tokens / _forwards(outs), 3),
        "ids": [o.token_ids for o in outs],
    }


def _forwards(outs) -> int:
    n = 0
    for o in outs:
        m = o.metrics
        plain_steps = (
            m["num_generated_tokens"] - 1 - m["num_accepted_tokens"] - m["num_verify_steps"]
        )
        n += 1 + m["num_verify_steps"] + max(plain_steps, 0)
    return n


def run_hf(model, prompts: list[list[int]], new_tokens: int, lookup: int | None) -> dict:
    tokens, seconds, ids = 0, 0.0, []
    for p in prompts:
        x = torch.tensor([p])
        kwargs = dict(do_sample=False, max_new_tokens=new_tokens, attention_mask=torch.ones_like(x))
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(x, **kwargs)[0, len(p) :].tolist()
            seconds += time.perf_counter() - t0
        tokens += len(out)
        ids.append(out)
    return {"tokens": tokens, "tok_per_s": tokens / seconds, "ids": ids}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per task set")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from outrider import LLM
    from outrider.bench.datasets import TASKS

    results = []
    for dtype in args.dtypes:
        plain = LLM(dtype=dtype, device="cpu", enable_prefix_caching=False)
        spec = LLM(
            dtype=dtype,
            device="cpu",
            enable_prefix_caching=False,
            speculative={"method": "ngram", "num_draft_tokens": args.num_draft_tokens},
        )
        path = plain.engine.checkpoint.path
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        ).eval()
        for task, texts in TASKS.items():
            prompts = [
                plain.encode_chat_text(plain.apply_chat_template([{"role": "user", "content": t}]))
                for t in texts[: args.prompts]
            ]
            run_outrider(plain, prompts[:1], 4)  # warm-up
            ours_plain = run_outrider(plain, prompts, args.new_tokens)
            ours_spec = run_outrider(spec, prompts, args.new_tokens)
            hf_plain = run_hf(hf, prompts, args.new_tokens, None)
            hf_lookup = run_hf(hf, prompts, args.new_tokens, args.num_draft_tokens)
            row = {
                "dtype": dtype,
                "task": task,
                "prompts": len(prompts),
                "new_tokens": args.new_tokens,
                "k": args.num_draft_tokens,
                "outrider_plain_tok_per_s": round(ours_plain["tok_per_s"], 2),
                "outrider_ngram_tok_per_s": round(ours_spec["tok_per_s"], 2),
                "outrider_ngram_speedup": round(
                    ours_spec["tok_per_s"] / ours_plain["tok_per_s"], 3
                ),
                "outrider_ngram_accept_length": ours_spec["accept_length"],
                "outrider_ngram_tokens_per_forward": ours_spec["tokens_per_forward"],
                "hf_plain_tok_per_s": round(hf_plain["tok_per_s"], 2),
                "hf_prompt_lookup_tok_per_s": round(hf_lookup["tok_per_s"], 2),
                "ngram_equals_plain": ours_spec["ids"] == ours_plain["ids"],
                "hf_lookup_equals_hf_plain": hf_lookup["ids"] == hf_plain["ids"],
            }
            results.append(row)
            print(row, flush=True)
        del plain, spec, hf
    summary = {
        "median_ngram_speedup_grounded": statistics.median(
            r["outrider_ngram_speedup"] for r in results if r["task"] == "grounded"
        ),
    }
    path = write_result("spec_cpu", {"results": results, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
