"""Train an EAGLE-3 drafter for the default model on one GPU, within a wall-clock budget, and
measure it: datagen (the target answers built-in and self-written prompts through outrider)
-> TTT training on features from the serving code -> per-step accuracy and the real accept
length on held-out prompts (outrider/bench/datasets.HELDOUT), chain and tree.

    python benchmarks/eagle3_train_default.py --out DIR [--samples 4000] [--max-new 384]
        [--train-minutes 5] [--draft-vocab 16384] [--device cuda] [--data JSONL]

Writes DIR/drafter (SGLang layout, bf16), DIR/data.jsonl, and benchmarks/results/
eagle3_train_default.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="train on this JSONL instead of generating one")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--train-minutes", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=100_000, help="step cap (the clock decides first)")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eval-tokens", type=int, default=128)
    args = ap.parse_args()

    from outrider import LLM, SamplingParams
    from outrider.bench.datasets import HELDOUT
    from outrider.models.eagle3_io import save_drafter
    from outrider.train.config import TrainConfig
    from outrider.train.datagen import generate_dataset
    from outrider.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    result: dict = {"args": vars(args)}
    t0 = time.perf_counter()
    # 1. Data: the target answers through outrider itself.
    llm = LLM(
        dtype=dtype, device=args.device, max_model_len=2048,
        **({"gpu_memory_utilization": 0.35, "max_num_seqs": 256, "cuda_graph_max_batch": 256}
           if cuda else {}),
    )  # fmt: skip
    if args.data:
        data = Path(args.data)  # a dataset from an earlier run: no generation
    else:
        # 4x more prompts per call than run at once: the engine refills finished slots, so
        # one long answer does not hold the batch (max_num_seqs is what runs together).
        data = generate_dataset(
            llm, out / "data.jsonl", num_samples=args.samples, max_new_tokens=args.max_new,
            batch_size=1024 if cuda else 8,
        )  # fmt: skip
    result["datagen_s"] = round(time.perf_counter() - t0, 1)
    print(f"datagen: {result['datagen_s']} s", flush=True)

    # 2. Train until the schedule ends or the wall-clock budget does.
    config = TrainConfig(
        data=str(data), output_dir=str(out / "run"), device=args.device, dtype=dtype,
        draft_vocab_size=args.draft_vocab, max_len=args.max_len, batch_rows=args.batch_rows,
        max_steps=args.steps, max_minutes=args.train_minutes, lr=args.lr,
        checkpoint_every=10**9, log_every=25,
    )  # fmt: skip
    trainer = Trainer(config, llm)
    start = time.perf_counter()
    train = trainer.run()
    train_s = time.perf_counter() - start
    steps = train.step
    draft = trainer.draft.eval()
    log = (out / "run" / "metrics.jsonl").read_text().splitlines()
    result["train_s"] = round(train_s, 1)
    result["train_log_tail"] = log[-3:]
    result["train_steps"] = steps
    shipped = out / "drafter"
    target = llm.engine.checkpoint.config
    extra = {
        "target": {"hidden_size": target.hidden_size, "num_hidden_layers": target.num_hidden_layers,
                   "vocab_size": target.vocab_size, "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)"},
        "trained_steps": result["train_steps"], "train_seconds": round(train_s),
        "samples": args.samples,
    }  # fmt: skip
    save_drafter(draft.to(torch.bfloat16), shipped, "sglang", extra)
    print(f"trained {result['train_steps']} steps in {train_s:.0f} s -> {shipped}", flush=True)
    del trainer, llm
    if cuda:
        torch.cuda.empty_cache()

    # 3. The real accept length on held-out prompts, chain of 4 and a tree.
    params = SamplingParams(temperature=0, max_tokens=args.eval_tokens)
    convs = [[{"role": "user", "content": p}] for p in HELDOUT]
    for name, spec in (
        ("chain_k4", {"num_draft_tokens": 4}),
        ("tree_k8_t3_s4", {"num_draft_tokens": 8, "topk": 3, "num_steps": 4}),
    ):
        eagle = LLM(
            dtype=dtype, device=args.device,
            speculative={"method": "eagle3", "draft": str(shipped), **spec},
            **({"gpu_memory_utilization": 0.2} if cuda else {}),
        )  # fmt: skip
        outs = eagle.chat(convs, params)
        steps_v = sum(o.metrics["num_verify_steps"] for o in outs)
        acc = sum(o.metrics["num_accepted_tokens"] for o in outs)
        result[f"accept_length_{name}"] = round(1 + acc / max(steps_v, 1), 3)
        print(f"{name}: accept length {result[f'accept_length_{name}']}", flush=True)
        del eagle
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(f"wrote {write_result('eagle3_train_default', result)}")


if __name__ == "__main__":
    main()
