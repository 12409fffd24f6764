"""Train an EAGLE-3 drafter for the default model on one GPU, within a wall-clock budget, and
measure it: datagen (the target answers built-in and self-written prompts through outrider)
-> TTT training on features from the serving code -> per-step accuracy and the real accept
length on held-out prompts (outrider/bench/datasets.HELDOUT and HELDOUT_FRESH), chain and tree.

    python benchmarks/eagle3_train_default.py --out DIR [--samples 4000] [--composed 0]
        [--max-new 384] [--train-minutes 5] [--draft-vocab 16384] [--device cuda] [--data JSONL]
        [--datagen-only] [--gen-minutes M] [--gen-procs 4] [--init DRAFTER]
        [--eval-tokens 128 512] [--eval-only DRAFTER] [--aux-layers 2 15 29]

Writes DIR/drafter (SGLang layout, bf16), DIR/data.jsonl, and benchmarks/results/
eagle3_train_default.json. `--datagen-only` stops after the data; runs given `--data` load a
small target of their own (a fixed KV pool), so several can train side by side on one GPU.
`--gen-procs N` generates the data in N processes (shards of one dataset, concatenated): at
large batches the engine's host work per step bounds one process, not the GPU. `--composed N`
puts N composed requests (outrider/train/composed.py) in the data. The held-out prompts and
their near-duplicates are excluded from the data. `--init DRAFTER` fine-tunes that drafter
(its weights and draft vocabulary) instead of starting from random weights; the saved
drafter's record keeps the record of the one it started from. The held-out accept length is measured at each
`--eval-tokens` answer length; `--eval-only DRAFTER` measures only that (e.g. the shipped
drafter) and writes benchmarks/results/eagle3_eval_default.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def _datagen(args, data: Path, shard: tuple[int, int], t0: float):
    """Generate (this shard of) the dataset into `data`; -> the LLM that did it."""
    from outrider import LLM
    from outrider.bench.datasets import HELDOUT, HELDOUT_FRESH
    from outrider.train.datagen import generate_dataset

    cuda = args.device.startswith("cuda")
    llm = LLM(
        dtype="bfloat16" if cuda else "float32", device=args.device, max_model_len=2048,
        # A fixed pool (prompt + answer fit in 48 blocks of 16), so shards share the GPU.
        **({"num_blocks": args.gen_seqs * 48, "max_num_seqs": args.gen_seqs,
            "cuda_graph_max_batch": args.gen_seqs} if cuda else {}),
    )  # fmt: skip
    # Many more prompts per call than run at once: the engine refills finished slots, so one
    # long answer does not hold the batch. Calls of growing size resume the same file (datagen
    # skips ids already written), so --gen-minutes can stop between them.
    batch = args.gen_batch if cuda else 8
    step = batch * shard[1]
    for upto in range(step, args.samples + step, step):
        generate_dataset(
            llm, data, num_samples=min(upto, args.samples), max_new_tokens=args.max_new,
            batch_size=batch, exclude=HELDOUT + HELDOUT_FRESH, shard=shard,
            composed=args.composed,
        )  # fmt: skip
        if args.gen_minutes and time.perf_counter() - t0 > args.gen_minutes * 60:
            print(f"datagen: stopped by --gen-minutes at {min(upto, args.samples)} prompts")
            break
    return llm


def _datagen_in_processes(args, out: Path) -> Path:
    """Run --gen-procs shards of this script's datagen side by side, spread over the visible
    GPUs; concatenate their files."""
    gpus = [None]
    if args.device == "cuda" and torch.cuda.device_count() > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(k) for k in range(torch.cuda.device_count())]
    procs = []
    for i in range(args.gen_procs):
        gpu = gpus[i % len(gpus)]
        env = os.environ if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        cmd = [sys.executable, __file__, "--out", str(out / f"shard{i}"), "--datagen-only",
               "--gen-shard", str(i), "--gen-procs", str(args.gen_procs),
               "--samples", str(args.samples), "--max-new", str(args.max_new),
               "--composed", str(args.composed),
               "--gen-batch", str(args.gen_batch), "--gen-seqs", str(args.gen_seqs),
               "--device", args.device, "--tag", f"{args.tag}shard{i}"]  # fmt: skip
        if args.gen_minutes:
            cmd += ["--gen-minutes", str(args.gen_minutes)]
        procs.append(subprocess.Popen(cmd, env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a datagen shard failed: see its output above")
    data = out / "data.jsonl"
    with open(data, "w") as f:
        for i in range(args.gen_procs):
            f.write((out / f"shard{i}" / "data.jsonl").read_text())
    return data


def _eval_heldout(args, drafter: Path, result: dict) -> None:
    """Serve `drafter` on the held-out prompts (temperature 0), chain of 4 and a tree, for each
    --eval-tokens length: result["accept_length_<spec>"] for the first length,
    "..._<spec>_<n>tok" for the others, and "..._noloop" over the answers that do not loop (a
    small target's answers grow repetitive with length, and drafts of repeated text are easy);
    HELDOUT_FRESH's keys end in "_fresh". result["heldout_offline"]: per-step accuracy and the
    confidence profile on the target's greedy answers to both sets, first length."""
    from outrider import LLM, SamplingParams
    from outrider.bench.datasets import HELDOUT, HELDOUT_FRESH
    from outrider.speculative.stats import accept_length

    cuda = args.device.startswith("cuda")
    sets = {"": HELDOUT, "_fresh": HELDOUT_FRESH}
    _profile_heldout(args, drafter, HELDOUT + HELDOUT_FRESH, result)
    for name, spec in (
        ("chain_k4", {"num_draft_tokens": 4}),
        ("tree_k8_t3_s4", {"num_draft_tokens": 8, "topk": 3, "num_steps": 4}),
    ):
        eagle = LLM(
            dtype="bfloat16" if cuda else "float32", device=args.device,
            speculative={"method": "eagle3", "draft": str(drafter), **spec},
            **({"num_blocks": 4096} if cuda else {}),  # fixed: side-by-side runs share the GPU
        )  # fmt: skip
        for (suffix, prompts), (i, n) in itertools.product(
            sets.items(), enumerate(args.eval_tokens)
        ):
            convs = [[{"role": "user", "content": p}] for p in prompts]
            outs = eagle.chat(convs, SamplingParams(temperature=0, max_tokens=n))
            steps_v = sum(o.metrics["num_verify_steps"] for o in outs)
            acc = sum(o.metrics["num_accepted_tokens"] for o in outs)
            key = f"accept_length_{name}" + (f"_{n}tok" if i else "") + suffix
            result[key] = round(accept_length(acc, steps_v) or 1.0, 3)
            print(f"{key}, {n} tokens: {result[key]}", flush=True)
            plain = [o for o in outs if not loops(o.token_ids)]
            if len(plain) < len(outs):
                steps_p = sum(o.metrics["num_verify_steps"] for o in plain)
                acc_p = sum(o.metrics["num_accepted_tokens"] for o in plain)
                key = f"accept_length_{name}" + (f"_{n}tok" if i else "") + "_noloop" + suffix
                result[key] = round(accept_length(acc_p, steps_p) or 1.0, 3)
                result[key.replace("accept_length", "answers")] = len(plain)
                print(f"{key} ({len(plain)} of {len(outs)} answers): {result[key]}", flush=True)
        del eagle


def loops(ids: list[int], window: int = 24) -> bool:
    """Whether an answer loops: some `window`-token stretch of its second half already occurs
    earlier in it."""
    half = len(ids) // 2
    if len(ids) < 2 * window:
        return False
    seen = {tuple(ids[i : i + window]) for i in range(half - window + 1)}
    return any(tuple(ids[i : i + window]) in seen for i in range(half, len(ids) - window + 1))


def _profile_heldout(args, drafter: Path, prompts: list[str], result: dict) -> None:
    """Offline, on the target's greedy answers: per-step top-1 accuracy, the estimated accept
    length, and the first draft's accuracy by the target's own confidence."""
    from outrider import LLM
    from outrider.models.eagle3_io import load_drafter
    from outrider.train.evaluate import confidence_profile, evaluate_drafter, greedy_samples

    cuda = args.device.startswith("cuda")
    llm = LLM(dtype="bfloat16" if cuda else "float32", device=args.device,
              **({"num_blocks": 4096} if cuda else {}))  # fmt: skip
    runner = llm.engine.runner
    samples = greedy_samples(llm, prompts, args.eval_tokens[0])
    draft = load_drafter(drafter, runner.model_config, device=runner.device, dtype=runner.dtype)
    res = evaluate_drafter(draft, llm, samples, ttt_steps=4)
    prof = confidence_profile(draft, llm, samples)
    result["heldout_offline"] = {
        "tokens": res.num_tokens,
        "step_acc": [round(a, 4) for a in res.step_acc],
        "estimated_accept_length_chain4": round(res.estimated_accept_length, 3),
        **prof.report(),
    }
    print(f"held-out offline: {result['heldout_offline']}", flush=True)
    del llm, draft


def _result_name(base: str, args) -> str:
    return base + (f"_{args.tag}" if args.tag else "")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="train on this JSONL instead of generating one")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--composed", type=int, default=0,
                    help="of --samples, this many composed requests (outrider/train/composed.py)")  # fmt: skip
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--train-minutes", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=100_000, help="step cap (the clock decides first)")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--eval-tokens",
        type=int,
        nargs="+",
        default=[128, 512],
        help="answer lengths the held-out accept length is measured at",
    )
    ap.add_argument(
        "--eval-only",
        default=None,
        metavar="DRAFTER",
        help="only measure this drafter on the held-out prompts",
    )
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--datagen-only", action="store_true", help="stop once the data is written")
    ap.add_argument("--gen-minutes", type=float, default=None, help="stop datagen after this")
    ap.add_argument("--gen-batch", type=int, default=4096, help="prompts per generate call")
    ap.add_argument("--gen-seqs", type=int, default=512, help="sequences decoded together")
    ap.add_argument("--gen-procs", type=int, default=1, help="datagen processes (shards)")
    ap.add_argument("--gen-shard", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--init", default=None, help="a drafter directory to fine-tune")
    ap.add_argument("--head-from-target", action="store_true",
                    help="start lm_head and the final norm from the target's")  # fmt: skip
    ap.add_argument("--align-topk", type=int, default=0, help="TrainConfig.align_topk")
    ap.add_argument("--hard-label", type=float, default=0.0, help="TrainConfig.hard_label")
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the drafter's MLP width (default: the target's)")  # fmt: skip
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None,
                    help="TrainConfig.aux_layers (default: EAGLE-3's 2, L//2, L-3)")  # fmt: skip
    args = ap.parse_args()

    from outrider.models.eagle3_io import save_drafter
    from outrider.train.config import TrainConfig
    from outrider.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    result: dict = {"args": vars(args)}
    t0 = time.perf_counter()
    if args.eval_only:
        _eval_heldout(args, Path(args.eval_only), result)
        print(f"wrote {write_result(_result_name('eagle3_eval_default', args), result)}")
        return
    # 1. Data: the target answers through outrider itself.
    if args.data:
        data = Path(args.data)  # a dataset from an earlier run: no generation
        llm = None  # the trainer loads its own target with a small fixed KV pool
    elif args.gen_procs > 1 and args.gen_shard is None:
        data = _datagen_in_processes(args, out)
        llm = None
    else:
        data = out / "data.jsonl"
        llm = _datagen(args, data, (args.gen_shard or 0, args.gen_procs), t0)
    result["datagen_s"] = round(time.perf_counter() - t0, 1)
    with open(data) as f:
        result["samples_written"] = sum(1 for _ in f)
    print(f"datagen: {result['samples_written']} samples, {result['datagen_s']} s", flush=True)
    if args.datagen_only:
        return

    # 2. Train until the schedule ends or the wall-clock budget does.
    config = TrainConfig(
        data=str(data), output_dir=str(out / "run"), device=args.device, dtype=dtype,
        draft_vocab_size=None if args.init else args.draft_vocab, init_from=args.init,
        max_len=args.max_len, batch_rows=args.batch_rows, max_steps=args.steps,
        max_minutes=args.train_minutes, lr=args.lr, checkpoint_every=500, log_every=25,
        head_from_target=args.head_from_target, align_topk=args.align_topk,
        hard_label=args.hard_label, intermediate_size=args.intermediate_size,
        aux_layers=args.aux_layers,
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
    target = trainer.capture.config
    extra = {
        "target": {"hidden_size": target.hidden_size, "num_hidden_layers": target.num_hidden_layers,
                   "vocab_size": target.vocab_size, "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)"},
        "trained_steps": result["train_steps"], "train_seconds": round(train_s),
        "samples": result["samples_written"], "lr": args.lr,
    }  # fmt: skip
    extra |= {k: getattr(args, k) for k in ("align_topk", "hard_label") if getattr(args, k)}
    if args.init:
        record = json.loads((Path(args.init) / "config.json").read_text()).get("outrider", {})
        extra["fine_tuned_from"] = {k: v for k, v in record.items() if k != "target"}
    save_drafter(draft.to(torch.bfloat16), shipped, "sglang", extra)
    print(f"trained {result['train_steps']} steps in {train_s:.0f} s -> {shipped}", flush=True)
    del trainer, llm, train, draft
    if cuda:
        torch.cuda.empty_cache()

    # 3. The real accept length on held-out prompts, chain of 4 and a tree.
    _eval_heldout(args, shipped, result)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(f"wrote {write_result(_result_name('eagle3_train_default', args), result)}")


if __name__ == "__main__":
    main()
