"""Where a drafter training step's time goes: the default model as the target, synthetic
samples of realistic length (a step's cost depends on the token count, not the values), the
trainer's own pieces run one after another with a device sync between them.

    python benchmarks/eagle3_train_profile.py [--steps 20] [--batch-rows 8] [--max-len 2048]
        [--device cuda] [--tag T]

Writes benchmarks/results/eagle3_train_profile.json: per phase (target features, target
distributions, the rest of the batch, TTT forward, backward, optimizer) the mean ms per step;
the step time without those syncs (what training runs at), tokens per second; the costliest
kernels of a few profiled steps; the process's peak resident memory (the host side of a GPU
run; on a CPU the whole run's, target included). The loop mirrors Trainer.run's body (one
micro-batch per step, no DDP); the phases are timed apart, so their sum exceeds the unsynced
step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

PHASES = ("features", "distributions", "batch", "forward", "backward", "optimizer")


def _synthetic_data(path: Path, num_samples: int, vocab: int, seed: int = 0) -> None:
    """Samples shaped like datagen's for the default model: a 20-80 token prompt, a 100-384
    token answer (loss-masked), ids drawn from the vocabulary's ordinary range."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_samples):
            p, a = rng.randint(20, 80), rng.randint(100, 384)
            ids = [rng.randrange(100, vocab) for _ in range(p + a)]
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * p + [1] * a}))
            f.write("\n")


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.ms = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.ms[name] += (time.perf_counter() - t) * 1e3


def _step(trainer, batch_rows: list, clock: _Clock | None, autocast) -> torch.Tensor:
    """One optimizer step on one micro-batch, as Trainer.run does it -> its loss-masked token
    count (on the device: no sync). The target's features and distributions are timed inside
    build_batch by wrapping the capture's methods for the call."""
    from outrider.train.batch import build_batch

    c, cap = trainer.config, trainer.capture
    timed = clock.phase if clock else lambda _name: contextlib.nullcontext()

    def wrapped(name):
        fn = getattr(cap, name)

        def call(*args, **kwargs):
            with timed(name):
                return fn(*args, **kwargs)

        return call

    cap.features, cap.distributions = wrapped("features"), wrapped("distributions")
    try:
        with timed("batch"):
            batch = build_batch(cap, trainer.samples, batch_rows, c.max_len, trainer.vocab)
    finally:
        del cap.features, cap.distributions  # the class's methods again
    with timed("forward"), autocast or contextlib.nullcontext():
        loss, *_ = trainer.module(batch)
    with timed("backward"):
        loss.backward()
    with timed("optimizer"):
        torch.nn.utils.clip_grad_norm_(trainer.draft.parameters(), c.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    return batch.loss_mask.sum()


def _top_kernels(prof, steps: int, n: int = 15) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev > 0:
            rows.append({"name": e.key[:120], "ms_per_step": round(dev / 1e3 / steps, 3),
                         "calls_per_step": round(e.count / steps, 1)})  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5, help="steps before timing (compiles)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    from outrider.train.config import TrainConfig
    from outrider.train.dataset import micro_batches, pack_rows
    from outrider.train.trainer import Trainer

    cuda = args.device.startswith("cuda")
    work = Path(tempfile.mkdtemp(prefix="train-profile-"))
    data = work / "data.jsonl"
    per_row = max(1, args.max_len // 310)  # samples average ~290 tokens
    steps = args.warmup + 2 * args.steps + args.profile_steps
    _synthetic_data(data, (per_row + 1) * args.batch_rows * steps, vocab=49152)
    config = TrainConfig(
        data=str(data), output_dir=str(work / "run"), device=args.device,
        dtype="bfloat16" if cuda else "float32", draft_vocab_size=args.draft_vocab,
        max_len=args.max_len, batch_rows=args.batch_rows, lr=1e-3, checkpoint_every=10**9,
    )  # fmt: skip
    trainer = Trainer(config)
    batches = iter(micro_batches(pack_rows(trainer.samples, args.max_len, 0, 0), args.batch_rows))
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else None
    for _ in range(args.warmup):
        _step(trainer, next(batches), None, autocast)
    clock = _Clock(trainer.device)
    tokens = 0
    for _ in range(args.steps):
        tokens += int(_step(trainer, next(batches), clock, autocast))  # synced anyway
    # The same steps without the syncs between phases: the rate training runs at.
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        _step(trainer, next(batches), None, autocast)
    if cuda:
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) * 1e3 / args.steps
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            _step(trainer, next(batches), None, autocast)
        if cuda:
            torch.cuda.synchronize()
    ms = dict(clock.ms)  # "batch" holds the features and distributions timed inside it
    ms["batch_rest"] = ms.pop("batch") - ms["features"] - ms["distributions"]
    result = {
        "args": vars(args),
        "phase_ms": {k: round(v / args.steps, 2) for k, v in ms.items()},
        "phases_sum_ms": round(sum(ms.values()) / args.steps, 2),
        "step_ms": round(step_ms, 2),
        "loss_tokens_per_step": tokens // args.steps,
        "loss_tokens_per_s": round(tokens / args.steps / step_ms * 1e3),
        "top_kernels": _top_kernels(prof, args.profile_steps) if cuda else [],
    }
    # Linux reports ru_maxrss in KiB: the same figure as `/usr/bin/time -v`'s maximum RSS.
    result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    if cuda:
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(result, indent=1), flush=True)
    name = "eagle3_train_profile" + (f"_{args.tag}" if args.tag else "")
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
