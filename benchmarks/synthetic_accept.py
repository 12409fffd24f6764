"""Synthetic acceptance: the speedup speculation buys at a chosen acceptance curve, measured in
the engine for a model that has no trained drafter, beside the planner's prediction.

    python benchmarks/synthetic_accept.py [--model llama-3.1-8b] [--curves 0.6,0.8,0.9] [--k 3]
        [--concurrency 1 16 64] [--prompt-len 128] [--new-tokens 256] [--gpu PROFILE.json]
    python benchmarks/synthetic_accept.py --smoke [--model moe-tiny]  # tiny, random, the CPU
    torchrun --standalone --nproc-per-node N benchmarks/synthetic_accept.py \
        --tensor-parallel-size N [--link pcie5-nop2p] ...  # the model over N GPUs

--model: a built-in shape (`llama-3.1-8b`, `tiny`; the DeepSeek-V3 family's `moonlight-16b-a3b`,
`kimi-k2.5` (its first --kimi-layers layers, INT4 experts) and `moe-tiny`) built with random
weights on the device, or a local model directory. Kimi's INT4 MoE layers hold one shared copy of
the routed experts (kimi_layers.shared_expert_storage: each layer still reads the experts it
routes to), so all 61 layers fit one GPU. A curve is one rate (the conditional acceptance at every draft
position: 0.8 gives P(position i accepted) = 0.8^i) or one rate a position, '/' between them
(0.9/0.8/0.6, the last repeating); --curves separates curves by commas.

Per concurrency C:
1. a plain greedy run (EOS ignored, --new-tokens each) gives every request's continuation and
   the plain decode tok/s;
2. per curve, a speculative run with k drafts a step: an EAGLE-3 draft layer of the target's
   shape with random weights runs inside every speculative step as it serves (its cost is
   real), and its drafts are replaced by the continuation corrupted so that position i is right
   with probability a_i given the ones before (outrider/testing/synthetic_drafter.py,
   outrider/testing/synthetic.py). Decode tok/s, accept length and per-position acceptance
   as the engine measured them; the output is compared with the plain run's (`lossless`).
3. the planner (outrider/plan) for the same shape, dtype, batch, k and mean context: its
   speedup at the target curve (`predicted_speedup`) and at the accept length the engine
   measured (`predicted_speedup_at_measured`, the figure to compare: the curve is only a
   target), and `ratio` = measured / predicted at measured.

What differs from a trained drafter: the drafts are chosen on the host in Python per request (a
few microseconds each) where a real drafter's come back in the step's one device read. In bf16
a speculative run can leave the plain run's continuation where a batched verify flips a
near-tie argmax; past that point the proposer drafts from the plain runs' token transitions
(counted in `off_continuation`, testing/synthetic.py), which predict these barely-writing
random layers as well as the continuation did.

Tensor parallelism: the random weights are built by every rank from the same seed, so a
built-in shape needs torchrun (ranks the engine spawns open a checkpoint directory); every rank
then runs eagerly and the planner is asked for tp N over --link. `measured_break_even` is the
accept length at which the speculative step would pay for itself as measured (speculative step
ms / plain step ms), beside the planner's `break_even_accept_len`.

Writes benchmarks/results/synthetic_accept.json (--out-dir: another directory, or a .json path).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from gpu_decode import LLAMA_8B, random_checkpoint  # noqa: E402
from kimi_layers import KIMI, shared_expert_storage  # noqa: E402
from kimi_layers import hf_config as kimi_hf_config  # noqa: E402
from kimi_layers import random_checkpoint as moe_random_checkpoint  # noqa: E402
from moe_gpu import MOONLIGHT  # noqa: E402
from moe_gpu import SMOKE as MOE_SMOKE  # noqa: E402

TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
    intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# The DeepSeek-V3 family: Moonlight-16B-A3B (bf16 experts), Kimi-K2.5's first 4 layers (INT4
# experts), and a tiny one for the CPU.
MOE_SHAPES = {
    "moonlight-16b-a3b": MOONLIGHT,
    "kimi-k2.5": kimi_hf_config(KIMI, 4, 1),
    "moe-tiny": MOE_SMOKE,
}
SHAPES = {"llama-3.1-8b": LLAMA_8B, "tiny": TINY, **MOE_SHAPES}


# Random weights of std 0.02 through 32 layers leave every argmax a near-tie, which a verify's
# batched GEMMs round differently from plain decoding's: on the 8B shape in bf16 the speculative
# run left the plain run's continuation within a few tokens (at C=1, 18 of 738 drafted
# positions stayed on it) and the accept length measured 1.03 whatever the curve. So each
# layer's writes into the residual stream (o_proj, down_proj) are scaled down by this: the next
# token then follows from the current one's embedding through the LM head, the same in decode
# and verify, while every GEMM still runs at full size (time does not depend on the values).
# 1e-3 was not enough (accept length 1.03-1.13 on the H200): an 8B layer's MLP write, 2e-5 x
# sqrt(14336) ~ 2.4e-3 per element, is still 12% of the embedding's 0.02. At 1e-5 it is 0.1%
# per layer (a 16-layer 1024-wide shape in bf16 on the CPU: accept length 1.05 -> 3.83 of 4).
# That left the LM head's near-ties (top two of 128k random logits ~4% apart): at C=16 on the
# H200 a few requests still flipped a token and, off their continuation, held the batch to
# 0.41-0.77 of the planner's speedup. With the head tied to the embedding the next token is the
# current one by a margin of ~80 logits against ~6, which no rounding flips.
RESIDUAL_WRITE_SCALE = 1e-5


def random_eagle3(runner, draft_vocab: int, seed: int = 0):
    """An EAGLE-3 drafter of the target's shape with random weights (time does not depend on
    them), draft ids mapped onto the first `draft_vocab` target ids."""
    from outrider.device import default_dtype
    from outrider.executor.drafter import Eagle3Drafter
    from outrider.models.eagle3 import Eagle3Config, Eagle3Draft

    target = runner.model_config
    cfg = Eagle3Config.for_target(target, min(draft_vocab, target.vocab_size))
    with default_dtype(runner.dtype), torch.device(runner.device):
        draft = Eagle3Draft(cfg, target.max_position_embeddings)
    g = torch.Generator(device=runner.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.02)
        draft.d2t.zero_()  # draft id i is target id i
        draft.t2d.zero_()
        draft.t2d[: cfg.draft_vocab_size] = True
    return Eagle3Drafter(draft.eval(), runner)


def decode_run(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Decode tok/s after an untimed prefill, and every request's output."""
    from outrider import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(len(r.output_token_ids) == 0 for r in reqs):
        engine.step()
    _sync(engine)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    _sync(engine)
    dt = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
    return {
        "tok_per_s": tokens / dt,
        "step_ms": dt / max(steps, 1) * 1e3,
        "steps": steps,
        "outputs": [list(r.output_token_ids) for r in reqs],
    }


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()  # CPU-GPU sync point: the timed region ends on the device


def planner_setup(engine, hf_config: dict, gpu: str | None, link: str = "nvlink4"):
    """The planner's view of what runs here: the shape in the engine's dtype, the GPU profile
    (--gpu, else the built-in row the device's name matches; the CPU's generic profile), the
    engine's tensor-parallel size over `link`."""
    from outrider.plan.calibrate import _host_memory_gb, cpu_profile
    from outrider.plan.cli import _gpu_by_name
    from outrider.plan.costmodel import Setup
    from outrider.plan.hardware import load_gpu, load_link
    from outrider.plan.models import from_hf_dict

    runner = engine.runner
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[runner.dtype]
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    base = from_hf_dict(hf_config)
    experts = base.expert_weights if hf_config.get("quantization_config") else None  # INT4
    model = dataclasses.replace(base, weights=name, expert_weights=experts, kv_bytes=elem)
    if gpu:
        profile = load_gpu(gpu)
    elif runner.device.type == "cuda":
        profile = _gpu_by_name(torch.cuda.get_device_name(runner.device))
    else:
        profile = cpu_profile(torch.get_num_threads(), _host_memory_gb())
    graphs = runner.graphs is not None
    return Setup(model, profile, load_link(link), runner.tp.size, graphs, graphs)


def build_engine(args):
    from outrider import env
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    max_c = max(args.concurrency)
    model: dict = {"dtype": dtype, "device": device, "cuda_graph_max_batch": max_c,
                   "max_model_len": args.prompt_len + args.new_tokens + 2 * args.k + 8}  # fmt: skip
    # The blocks the runs need, not a share of the device: a drafter's pool takes as many
    # blocks as the target's, and beside an MLA target's few layers of latents (Kimi's first
    # 4: 4.6 KB a token) its multi-head KV (32 KB a token) would not fit a pool sized by memory.
    per_seq = -(-model["max_model_len"] // 16) + 1
    cache: dict = {"enable_prefix_caching": False, "num_blocks": max_c * per_seq + 8}
    tp = getattr(args, "tensor_parallel_size", 1)
    config = EngineConfig().replace(
        model=model, cache=cache,
        scheduler={"max_num_seqs": max_c, "max_num_batched_tokens": max(2048, args.prompt_len)},
        speculative={"num_draft_tokens": args.k, "controller": args.controller},
        parallel={"tensor_parallel_size": tp},
    )  # fmt: skip
    key = args.model.strip().lower()
    if key in SHAPES and tp > 1 and env.world_size() == 1:
        raise SystemExit(
            f"--model {args.model} --tensor-parallel-size {tp}: random weights cannot be opened "
            f"by ranks the engine spawns; launch with torchrun --standalone --nproc-per-node "
            f"{tp} (every rank builds the same weights), or pass a model directory"
        )
    if key in SHAPES:
        hf = dict(SHAPES[key])
        if key == "kimi-k2.5":
            hf = kimi_hf_config(KIMI, args.kimi_layers, 1)
        make, share = random_checkpoint, {}
        if key in MOE_SHAPES:  # INT4 layers share one copy of the routed experts
            make, share = moe_random_checkpoint, {"share_experts": True}
        checkpoint = make(
            hf, device, getattr(torch, dtype), residual_write_scale=RESIDUAL_WRITE_SCALE,
            tied_head=True, **share,
        )  # fmt: skip
        with shared_expert_storage():
            engine = EngineCore(config, checkpoint)
        return engine, hf
    if not Path(args.model).expanduser().is_dir():
        raise SystemExit(
            f"--model {args.model!r}: use a built-in shape ({', '.join(SHAPES)}) or a local "
            "model directory"
        )
    config = config.replace(model={"model": str(Path(args.model).expanduser())})
    engine = EngineCore(config)
    return engine, dict(engine.checkpoint.hf_config)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--curves", default="0.6,0.8,0.9")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument(
        "--kimi-layers", type=int, default=4,
        help="kimi-k2.5: the layers built (1 dense, then INT4 MoE sharing one copy of the "
        "routed experts: all 61 take ~33 GB)",
    )  # fmt: skip
    ap.add_argument(
        "--controller", default="fixed", choices=["fixed", "adaptive"],
        help="fixed: k drafts every step; adaptive: the engine's controller chooses 0..k a step",
    )  # fmt: skip
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--gpu", default=None, help="planner GPU: a built-in name or a profile JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--link", default="nvlink4", help="planner link at tensor parallelism > 1")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU, seconds")
    args = ap.parse_args()
    payload = run(args)
    if payload is not None:  # rank 0 (the other ranks of a torchrun job return None)
        path = write_result("synthetic_accept", payload, args.out_dir)
        print(f"wrote {path}")
    if args.tensor_parallel_size > 1:
        from outrider.executor.tp_workers import leave_process

        leave_process(0)


def run(args: argparse.Namespace) -> dict | None:
    """The measurement main() describes, on the engine `args` build; the payload, on rank 0.
    Under torchrun ranks > 0 follow rank 0 inside build_engine and end their process there."""
    if args.smoke:
        # The tiny Llama, or with --model moe-tiny the tiny DeepSeek-V3 (MLA, routed experts).
        args.model = "moe-tiny" if args.model == "moe-tiny" else "tiny"
        args.device, args.dtype = "cpu", "float32"
        args.concurrency, args.prompt_len, args.new_tokens = [1, 4], 16, 24
        args.curves = "1.0,0.5"
        torch.set_num_threads(1)  # tiny shapes: a second thread only adds contention
    if args.k < 1 or min(args.concurrency) < 1 or args.new_tokens < 2:
        raise SystemExit(
            f"--k {args.k}, --concurrency {args.concurrency}, --new-tokens {args.new_tokens}: "
            "use k >= 1, concurrency >= 1, new tokens >= 2"
        )

    from outrider.plan.planner import Drafter, plan_batch
    from outrider.speculative.controller import expected_tokens
    from outrider.testing.synthetic import (
        SyntheticProposer,
        curve_at,
        measured_curve,
        parse_curve,
    )
    from outrider.testing.synthetic_drafter import SyntheticDrafter

    curves = [parse_curve(c) for c in args.curves.split(",")]
    engine, hf = build_engine(args)
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = {
        c: [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(c)]
        for c in args.concurrency
    }
    decode_run(engine, prompts[min(args.concurrency)][:1], 4)  # warm-up (lazy inits)
    plain = {}
    for c in args.concurrency:
        plain[c] = decode_run(engine, prompts[c], args.new_tokens)
        print(f"plain C={c}: {plain[c]['tok_per_s']:.1f} tok/s", flush=True)

    drafter = random_eagle3(engine.runner, args.draft_vocab, args.seed)
    wrapper = SyntheticDrafter(drafter, SyntheticProposer({}, [1.0], vocab))
    # Captures the speculative step's graphs, drafter included.
    engine.speculator.use_proposer(wrapper)
    first = prompts[min(args.concurrency)][0]
    warm = {tuple(first): plain[min(args.concurrency)]["outputs"][0]}
    wrapper.use_proposer(SyntheticProposer(warm, [1.0], vocab))
    decode_run(engine, [first], 2 * args.k + 2)  # warm-up of the speculative step
    # And of every path a timed run may take at each concurrency (plain steps between
    # speculative ones under the adaptive controller, the drafter catching up after them):
    # their kernels compile at first use, which the timed runs must not pay. As long as the
    # timed runs: a drafter deferring rows through plain steps catches up over them all
    # after 64 steps (executor/drafter.py), a forward over the prompts too, of shapes no
    # shorter run makes.
    for c in args.concurrency:
        cont = {tuple(p): o for p, o in zip(prompts[c], plain[c]["outputs"])}
        wrapper.use_proposer(SyntheticProposer(cont, curves[-1], vocab, args.seed))
        decode_run(engine, prompts[c], args.new_tokens)
    setup = planner_setup(engine, hf, args.gpu, getattr(args, "link", "nvlink4"))
    plan_drafter = Drafter("eagle3", vocab_size=drafter.draft.config.draft_vocab_size)
    context = args.prompt_len + args.new_tokens // 2
    rows = []
    for curve in curves:
        for c in args.concurrency:
            cont = {tuple(p): o for p, o in zip(prompts[c], plain[c]["outputs"])}
            wrapper.use_proposer(SyntheticProposer(cont, curve, vocab, args.seed))
            engine.speculator.reset_stats()
            spec = decode_run(engine, prompts[c], args.new_tokens)
            stats, counts = engine.speculator.stats, wrapper.proposer.counts
            measured = stats.accept_length or 1.0
            option = plan_batch(setup, plan_drafter, c, context, list(curve), args.k).chains[-1]
            at_measured = measured * option.decode_ms / option.spec_ms
            speedup = spec["tok_per_s"] / plain[c]["tok_per_s"]
            row = {
                "curve": list(curve),
                "concurrency": c,
                "k": args.k,
                "accept_length": round(measured, 4),
                "target_accept_length": round(expected_tokens(curve_at(curve, args.k), args.k), 4),
                "acceptance_per_position": [
                    round(a, 4)
                    for a in measured_curve(stats.accepted_per_position, stats.num_verify_steps)
                ],
                "num_verify_steps": stats.num_verify_steps,
                "tok_per_s": round(spec["tok_per_s"], 2),
                "plain_tok_per_s": round(plain[c]["tok_per_s"], 2),
                "step_ms": round(spec["step_ms"], 4),
                "plain_step_ms": round(plain[c]["step_ms"], 4),
                "speedup": round(speedup, 4),
                "predicted_speedup": round(option.speedup, 4),
                "predicted_speedup_at_measured": round(at_measured, 4),
                "ratio": round(speedup / at_measured, 4),
                "predicted_ms": {
                    "decode": round(option.decode_ms, 4),
                    "verify": round(option.verify.ms, 4),
                    "draft": round(option.draft.ms, 4),
                    "break_even_accept_len": round(option.break_even, 4),
                },
                "measured_break_even": round(spec["step_ms"] / plain[c]["step_ms"], 4),
                "lossless": spec["outputs"] == plain[c]["outputs"],
                "on_continuation": counts.on_continuation,
                "off_continuation": counts.off_continuation,
                "diverged_requests": len(counts.diverged_requests),
            }
            rows.append(row)
            print(
                f"curve {'/'.join(map(str, curve))} C={c}: L={row['accept_length']} "
                f"(target {row['target_accept_length']}), speedup {row['speedup']} vs "
                f"predicted {row['predicted_speedup_at_measured']} at L "
                f"({row['predicted_speedup']} at the curve), ratio {row['ratio']}",
                flush=True,
            )
    steps = runner_steps(engine, setup, plan_drafter, args)
    engine.shutdown()  # the other tensor-parallel ranks stop (nothing on one rank)
    return {
        "model": args.model,
        "layers": hf.get("num_hidden_layers"),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "planner_gpu": setup.gpu.name,
        "tensor_parallel_size": setup.tp,
        "planner_link": setup.link.name,
        "graphs": setup.graphs,
        "k": args.k,
        "controller": args.controller,
        "curves": [list(c) for c in curves],
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "mean_context": context,
        "draft_vocab": plan_drafter.vocab_size,
        "rows": rows,
        "runner_steps": steps,
    }


def runner_steps(engine, setup, plan_drafter, args) -> list[dict] | None:
    """Where a gap between measured and predicted speedup lies: the runner's own plain and
    speculative steps (the drafter's forwards included) at each concurrency, their wall and
    device times (executor/step_timing.py, dummy rows at short contexts), beside the
    planner's decode and verify + draft at the same shape (context 1). The engine's steps
    above also pay the scheduler's and the proposer's host work; these do not. On one CUDA
    device only (None elsewhere)."""
    from outrider.executor.step_timing import profile_steps
    from outrider.plan.planner import plan_batch

    if engine.runner.device.type != "cuda" or setup.tp > 1:
        return None
    table, device = profile_steps(
        engine.runner, [args.k], args.concurrency, device_time=True
    )  # fmt: skip
    out = []
    for c in args.concurrency:
        option = plan_batch(setup, plan_drafter, c, 1, [1.0], args.k).chains[-1]
        out.append({
            "concurrency": c,
            "plain_ms": round(table[c][0], 4),
            "plain_device_ms": round(device[c][0], 4),
            "spec_ms": round(table[c][args.k], 4),
            "spec_device_ms": round(device[c][args.k], 4),
            "predicted_plain_ms": round(option.decode_ms, 4),
            "predicted_spec_ms": round(option.spec_ms, 4),
            "predicted_draft_ms": round(option.draft.ms, 4),
        })  # fmt: skip
        print(f"runner steps C={c}: {out[-1]}", flush=True)
    return out


if __name__ == "__main__":
    main()
