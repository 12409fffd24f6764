"""The TTT loss over the draft vocabulary, a training step's worth (7 unrolled steps), forward
and backward: the fused soft cross-entropy (outrider/train/soft_ce.py) against the
log-softmax formula it replaced, side by side in one run on the same inputs.

    python benchmarks/ttt_loss.py [--rows 8] [--tokens 2048] [--vocab 16384] [--iters 10]

Writes benchmarks/results/ttt_loss.json: ms per 7-step loss (forward + backward) for each,
peak memory, and how far the fused loss and gradient are from the reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402


def reference(logits, target, steps):
    """The loss as ttt._score computed it before soft_ce (log_softmax on fp32 slices)."""
    t = logits.shape[1]
    total, args = 0.0, []
    for j in range(steps):
        s, keep = 1 + j, t - 1 - j
        z = logits.float()[:, :keep]
        logp = F.log_softmax(z, dim=-1)
        total = total + 0.8**j * (-(target[:, s:].float() * logp).sum(-1)).mean()
        args.append(z.argmax(-1))
    return total, args


def fused(logits, target, steps):
    from outrider.train.soft_ce import soft_ce

    t = logits.shape[1]
    total, args = 0.0, []
    for j in range(steps):
        ce, _, arg = soft_ce(logits, target, 1 + j, t - 1 - j)
        total = total + 0.8**j * ce.mean()
        args.append(arg)
    return total, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the logits' dtype under autocast
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (args.rows, args.tokens, args.vocab)
    logits = (torch.randn(shape, device=dev, generator=g) * 4).to(dtype).requires_grad_(True)
    target = torch.softmax(torch.randn(shape, device=dev, generator=g) * 3, -1) * 0.95

    def run(fn):
        logits.grad = None
        loss, arg = fn(logits, target, args.steps)
        loss.backward()
        return loss.detach(), arg, logits.grad

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(args.iters):
            run(fn)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3 / args.iters
        return ms, (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)

    loss_r, arg_r, grad_r = run(reference)
    grad_r = grad_r.clone()
    loss_f, arg_f, grad_f = run(fused)
    result = {
        "args": vars(args),
        "loss_diff": abs(loss_r.item() - loss_f.item()),
        "argmax_equal": all(torch.equal(a, b) for a, b in zip(arg_r, arg_f)),
        "grad_max_diff": (grad_r.float() - grad_f.float()).abs().max().item(),
        "grad_scale": grad_r.float().abs().max().item(),
    }
    del grad_r
    times = {"reference": [], "fused": []}
    for _ in range(2):  # alternate, so drift hits both
        for name, fn in (("reference", reference), ("fused", fused)):
            times[name].append(timed(fn))
    for name, got in times.items():
        result[f"{name}_ms"] = round(min(ms for ms, _ in got), 2)
        if cuda:
            result[f"{name}_peak_gib"] = round(max(m for _, m in got), 2)
    result["speedup"] = round(result["reference_ms"] / result["fused_ms"], 2)
    print(result, flush=True)
    print(f"wrote {write_result('ttt_loss' + (f'_{args.tag}' if args.tag else ''), result)}")


if __name__ == "__main__":
    main()
