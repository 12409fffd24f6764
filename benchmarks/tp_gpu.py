"""Tensor parallelism on one host's GPUs, measured the way it is run: output equality with one
rank, step times beside the planner's, the collectives' cost, and speculation's break-even.

    python benchmarks/tp_gpu.py --gpus 2 --out-dir $OUT          # 2 GPUs, about 8 minutes
    python benchmarks/tp_gpu.py --gpus 8 --out-dir $OUT          # 8 GPUs (8B: 32 heads, 8 KV)
    python benchmarks/tp_gpu.py --gpus 2 --quick --out-dir $OUT  # fewer points, a few minutes
    python benchmarks/tp_gpu.py --smoke --out-dir /tmp/tp        # CPU, gloo, 2 ranks, ~1 min
    python benchmarks/tp_gpu.py --gpus 2 --parts equality timings --out-dir $OUT
    python benchmarks/tp_gpu.py --gpus 8 --model kimi-k2.5 --out-dir $OUT   # 8 GPUs, ~10 min
    python benchmarks/tp_gpu.py --smoke --model kimi-k2.5 --out-dir /tmp/tp  # CPU, tiny MLA/MoE

Parts (--parts picks; each writes into one JSON, tp_gpu.json or tp_gpu_smoke.json in --out-dir,
rewritten after every part, so a run cut short keeps what finished):

1. equality: a random Llama-shape model (8 heads, 4 KV heads, 4 layers, vocab 4096, fp32)
   written with safetensors to a temporary directory, served by LLM(dir) and by
   LLM(dir, tensor_parallel_size=N), which spawns ranks 1..N-1 that open the same directory
   (random weights held in memory cannot reach them). Greedy, EOS ignored: TP=N plain, with
   n-gram drafts, and with an EAGLE-3 drafter on rank 0 (random, untrained: acceptance is
   near zero, so this checks losslessness and the drafter's place, not its speedup) must each
   give the TP=1 plain output token for token.
2. timings: the Llama-3.1-8B shape with random bf16 weights, through the engine's own step
   timing (ModelRunner.profile_steps: a decode step and the verify step of 1 + k tokens on
   dummy rows, median of reps) at TP=1 and TP=N, C sequences a step. TP=N runs under torchrun,
   where every rank builds the same seeded weights on its own GPU and ranks > 0 follow rank 0's
   steps (tp_channel); CUDA graphs are on at TP=1 and TP=N alike, every rank replaying the
   graph rank 0 names, the all-reduces inside it (`cuda_graphs` in each setting says whether
   graphs ran). TP=N runs twice, each in its own processes
   since NCCL reads its environment once: as the machine is (NVLink) and with
   NCCL_P2P_DISABLE=1 (through host memory: a stand-in for PCIe without P2P). Beside each
   point: all-reduces, all-gathers and bytes per forward as the engine counted them, the
   planner's count, and its predicted ms on the built-in link (nvlink4, pcie5-nop2p) and on the
   link `bench comm` measured here, with the error.
3. synthetic: benchmarks/synthetic_accept.py at TP=N with NCCL_P2P_DISABLE=1 on the 8B shape
   (a random EAGLE-3 drafter on rank 0 whose drafts are replaced by a chosen acceptance
   curve): accept length and speedup measured, the measured break-even accept length
   (speculative step / plain step) beside the planner's for tp N over pcie5-nop2p.
4. comm: `outrider bench comm` over the N GPUs, each NCCL candidate in its own processes
   (--quick: four of them); over gloo with --smoke.
5. draft: the EAGLE-3 chain step (verify 1 + k, then the drafter's k next drafts) at TP=N
   with the drafter whole on rank 0 (draft_tensor_parallel_size 1) and split over every rank
   like the target (draft_tensor_parallel_size N), side by side: the 8B shape (--smoke: an
   8-layer tiny one) with a random drafter of its shape written to a temporary directory that
   every rank loads, each setting under torchrun in its own processes, both eager (the split
   drafter's other ranks follow eagerly only), timed by ModelRunner.profile_steps; beside each
   point the split over rank 0 ratio and the collectives a verify and a draft forward ran.

--model kimi-k2.5: the Kimi-K2.5 shape (benchmarks/kimi_layers.py's random weights: all 61
layers, MLA, 384 routed experts in INT4 group 32 made on each rank's GPU, ~76 GB a GPU at TP=8;
--layers cuts it) for the timings and comm parts (its default parts): TP=1 is skipped where the
model cannot fit one GPU (more than 8 layers); each verify point also carries the measured
break-even accept length of a proposer that costs nothing (verify ms / decode ms at that C).
Written as tp_gpu_kimi.json. --smoke with it: the tiny model of the same
family on the CPU.

--budget-s (default 480) bounds the whole run: a part that would start past it is skipped and
says so, and comm's candidates share what is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from common import write_result  # noqa: E402
from gpu_decode import LLAMA_8B, random_checkpoint  # noqa: E402
from kimi_layers import KIMI, SMOKE, hf_config  # noqa: E402
from synthetic_accept import TINY  # noqa: E402
from tp_gpu_tables import TABLES  # noqa: E402

# Heads, KV heads, vocabulary and MLP divide by 2, 4 and 8 (KV heads replicate at 8).
EQUALITY_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
    intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
NGRAM = {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"}
P2P_OFF = {"NCCL_P2P_DISABLE": "1"}
QUICK_CANDIDATES = ("default", "p2p-off", "proto-LL", "proto-Simple")
GRAPHS_NOTE = (
    "CUDA graphs on at every tensor-parallel size: at TP > 1 every rank captures the same graphs "
    "and replays the one rank 0 names each step, NCCL all-reduces inside (executor/tp_graphs.py); "
    "the drafter's graphs run on rank 0 alone, trees verify eagerly at TP > 1"
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: smoke (CPU), quick or full."""

    hf: dict
    device: str
    dtype: str
    batch_sizes: tuple[int, ...]
    ks: tuple[int, ...]
    reps: int
    new_tokens: int  # equality

    @classmethod
    def of(cls, args: argparse.Namespace) -> Sizes:
        if args.model == "kimi-k2.5":
            if args.smoke:
                return cls(hf_config(SMOKE, 3, 1), "cpu", "float32", (1, 4), (0, 1, 3), 2, 0)
            hf = hf_config(KIMI, args.layers, 1)
            return cls(hf, "cuda", "bfloat16", (1, 8, 32, 64), (0, 1, 3, 7, 15), 5, 0)
        if args.smoke:
            return cls(TINY, "cpu", "float32", (1, 4), (0, 1, 3), 2, 12)
        if args.quick:
            return cls(LLAMA_8B, "cuda", "bfloat16", (1, 32), (0, 3, 15), 5, 24)
        return cls(LLAMA_8B, "cuda", "bfloat16", (1, 8, 32, 64), (0, 1, 3, 7, 15), 10, 32)

    @property
    def moe(self) -> bool:
        """Kimi's shape (routed experts), not Llama's."""
        return bool(self.hf.get("n_routed_experts"))


# -- 1. equality -------------------------------------------------------------------------------


def write_random_model(hf: dict, directory: Path) -> Path:
    """random_checkpoint's seeded weights of `hf` (std 0.05: logits far from ties) as an HF
    directory: config.json, model.safetensors, and a word-level tokenizer naming every id."""
    import tokenizers
    from safetensors.torch import save_file

    ckpt = random_checkpoint(hf, "cpu", torch.float32, std=0.05)
    save_file({n: t.contiguous() for n, t in ckpt.iter_tensors()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({**hf, "torch_dtype": "float32"}))
    vocab = {f"t{i}": i for i in range(hf["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    return directory


def equality(n: int, sizes: Sizes) -> dict:
    """TP=N greedy output against TP=1's, plain, n-gram and EAGLE-3 (see the module's doc)."""
    import gc

    from synthetic_accept import random_eagle3

    from outrider import LLM, SamplingParams

    hf = EQUALITY_SHAPE
    device = "cuda" if sizes.device == "cuda" else "cpu"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf["vocab_size"], (m,), generator=g).tolist() for m in (5, 33, 60)]
    prompts.append([7, 8, 9, 10] * 6)  # repeats: n-gram drafts from the first step
    params = SamplingParams(temperature=0, max_tokens=sizes.new_tokens, ignore_eos=True)
    opts = dict(dtype="float32", device=device, num_blocks=256, max_model_len=512)
    cases = []

    def case(name: str, llm, want: list | None) -> list:
        engine = llm.engine
        engine.runner.reset_collective_counts()
        verifies = engine.speculator.stats.num_verify_steps
        t0 = time.perf_counter()
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        row = {"case": name, "seconds": round(time.perf_counter() - t0, 2),
               "verify_steps": engine.speculator.stats.num_verify_steps - verifies,
               "per_forward": per_forward(engine.runner.collective_counts())}  # fmt: skip
        if want is not None:
            row["equal"] = outs == want
            row["first_difference"] = first_difference(want, outs)
        cases.append(row)
        return outs

    with tempfile.TemporaryDirectory(prefix="outrider-tp-eq-") as tmp:
        path = str(write_random_model(hf, Path(tmp)))
        with LLM(path, **opts, speculative=NGRAM) as one:
            ngram = one.engine.speculator.proposer
            one.engine.speculator.use_proposer(None)
            want = case("tp1 plain", one, None)
            one.engine.speculator.use_proposer(ngram)
            case("tp1 ngram", one, want)
        del one
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        # Graphs at TP > 1 are opt-in: asked for on CUDA, so a run that cannot capture fails.
        graphs_opt = {"cuda_graphs": True} if device == "cuda" else {}
        with LLM(path, **opts, **graphs_opt, speculative=NGRAM, tensor_parallel_size=n) as llm:
            case(f"tp{n} ngram", llm, want)
            llm.engine.speculator.use_proposer(random_eagle3(llm.engine.runner, 1024))
            case(f"tp{n} eagle3 (random drafter on rank 0)", llm, want)
            llm.engine.speculator.use_proposer(None)
            case(f"tp{n} plain", llm, want)
            graphs = llm.engine.runner.graphs is not None
    return {
        "settings": {"shape": hf, "dtype": "float32", "device": device, "tp": n,
                     "prompt_lens": [len(p) for p in prompts], "new_tokens": sizes.new_tokens,
                     "ranks_started_by": "LLM(tensor_parallel_size=N): spawned, opening the "
                     "model directory", "tp_cuda_graphs": graphs,
                     "eagle3": "random untrained drafter (synthetic_accept.random_eagle3): "
                     "checks losslessness, not acceptance"},
        "cases": cases,
        "all_equal": all(c.get("equal", True) for c in cases),
    }  # fmt: skip


def first_difference(want: list[list[int]], got: list[list[int]]) -> dict | None:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {"prompt": i, "token": j}
    return None


def per_forward(counts: dict) -> dict:
    """{mode: {collective: {"calls", "bytes"} per forward}} from the runner's counts."""
    out = {}
    for mode, ops in counts.items():
        n = ops.get("forward", {}).get("calls", 0)
        if n:
            out[mode] = {op: {"calls": round(v["calls"] / n, 3), "bytes": round(v["bytes"] / n)}
                         for op, v in ops.items() if op != "forward"} | {"forwards": n}  # fmt: skip
    return out


# -- 2. step timings (run in a child: torchrun at TP > 1) --------------------------------------


def timings_child(tp: int, sizes: Sizes) -> dict | None:
    """Rank 0's profile_steps table at every (C, k) and the collectives a forward ran; None on
    ranks > 0 (under torchrun they follow rank 0 inside EngineCore and end their process there)."""
    from outrider import env
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    cuda = sizes.device == "cuda"
    top = max(sizes.batch_sizes)
    cache = {"enable_prefix_caching": False}
    # Kimi's weights take ~76 GB of a GPU at TP=8: the KV cache gets what its share leaves.
    memory = 0.9 if sizes.moe else 0.5
    cache |= {"gpu_memory_utilization": memory} if cuda else {"num_blocks": 64}
    config = EngineConfig().replace(
        # Graphs asked for on CUDA (an error rather than a silently eager run); the CPU has none.
        model={"device": sizes.device, "dtype": sizes.dtype, "max_model_len": 1024,
               "cuda_graph_max_batch": top, "cuda_graphs": True if cuda else None},
        cache=cache, scheduler={"max_num_seqs": top},
        parallel={"tensor_parallel_size": tp},
    )  # fmt: skip
    t0 = time.perf_counter()
    device = sizes.device
    if cuda:  # each rank makes its weights on its own GPU (torchrun's LOCAL_RANK)
        torch.cuda.set_device(env.local_rank())
        device = f"cuda:{env.local_rank()}"
    engine = EngineCore(config, build_checkpoint(sizes, device))
    runner = engine.runner
    spec_ks = tuple(k for k in sizes.ks if k > 0)
    runner.set_speculation(None, spec_ks)  # host drafts: the verify step alone, as n-gram runs
    runner.capture_graphs()
    start_s = time.perf_counter() - t0
    points = []
    for b in sizes.batch_sizes:
        for k in sizes.ks:
            # One k a call: the counts then hold this verify shape alone (a call also times a
            # decode step, under its own mode).
            runner.reset_collective_counts()
            table = runner.profile_steps([k] if k else [], [b], sizes.reps)
            mode = "verify" if k else "decode"
            counts = per_forward(runner.collective_counts()).get(mode)
            points.append({"batch": b, "k": k, "measured_ms": round(table[b][k], 4),
                           "collectives": counts})  # fmt: skip
            print(f"[timings tp={tp}] C={b} k={k}: {table[b][k]:.3f} ms", flush=True)
    engine.shutdown()
    return {
        "tp": tp,
        "device_name": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": sizes.dtype,
        "cuda_graphs": runner.graphs is not None,
        "backend": "nccl" if cuda and tp > 1 else ("gloo" if tp > 1 else None),
        "attention_backend": runner.backend.name,
        "engine_start_s": round(start_s, 1),
        "reps": sizes.reps,
        "points": points,
    }


def planner_model(hf: dict, dtype: str):
    """The planner's model of the random weights: every linear layer in `dtype`, routed experts
    as the config stores them (Kimi's INT4; the Llama shape has none)."""
    from outrider.plan.models import from_hf_dict

    name, elem = {"bfloat16": ("bf16", 2), "float16": ("fp16", 2), "float32": ("fp32", 4)}[dtype]
    return dataclasses.replace(from_hf_dict(hf), weights=name, kv_bytes=elem)


def build_checkpoint(sizes: Sizes, device: str):
    """The seeded random weights of sizes.hf on `device`: Kimi's (kimi_layers) or Llama's."""
    if sizes.moe:
        from kimi_layers import random_checkpoint as kimi_checkpoint

        return kimi_checkpoint(sizes.hf, device, getattr(torch, sizes.dtype))
    return random_checkpoint(sizes.hf, device, getattr(torch, sizes.dtype))


def fits_one_gpu(sizes: Sizes) -> bool:
    """Whether TP=1 can hold the model: Kimi's 61 layers are ~570 GB of INT4 experts."""
    return sizes.device == "cpu" or not sizes.moe or sizes.hf["num_hidden_layers"] <= 8


def planner_gpu(device_name: str, threads: int):
    from outrider.plan.calibrate import _host_memory_gb, cpu_profile
    from outrider.plan.cli import _gpu_by_name

    if device_name == "cpu":
        return cpu_profile(threads, _host_memory_gb())
    return _gpu_by_name(device_name)


def predict(model, gpu, link, tp: int, graphs: bool, batch: int, k: int) -> dict:
    """The planner's ms for profile_steps' step (rows of 1 + k tokens at context 0) and the
    collectives it counts for one forward of it."""
    from outrider.plan.calibrate import Point, predict_ms
    from outrider.plan.costmodel import Setup, decode_cost, forward_kernels, verify_cost

    _, collectives, _ = forward_kernels(model, tp, batch, 1 + k, 0)
    count = {c.kind: sum(1 for x in collectives if x.kind == c.kind) for c in collectives}
    moved = {kind: sum(x.bytes for x in collectives if x.kind == kind) for kind in count}
    if tp == 1:
        ms = predict_ms(model, gpu, Point(batch, k, 1.0), graphs)
    else:
        setup = Setup(model, gpu, link, tp, graphs, graphs)
        ms = (verify_cost(setup, batch, 1 + k, 0) if k else decode_cost(setup, batch, 0)).ms
    return {"ms": ms, "calls": count, "bytes": moved}


def add_predictions(setting: dict, hf: dict, links: dict) -> None:
    """Each point's planner figures over every link in `links` ({label: Link})."""
    model = planner_model(hf, setting["dtype"])
    gpu = planner_gpu(setting["device_name"], setting["threads"])
    setting["planner_gpu"] = gpu.name
    for p in setting["points"]:
        p["predicted"] = {}
        for label, link in links.items():
            got = predict(
                model, gpu, link, setting["tp"], setting["cuda_graphs"], p["batch"], p["k"]
            )
            p["predicted"][label] = {
                "ms": round(got["ms"], 4),
                "error": round(got["ms"] / p["measured_ms"] - 1, 4),
            }
        p["planner_collectives"] = {"calls": got["calls"], "bytes": got["bytes"]}


def measured_link(comm: dict | None, candidate: str):
    """The Link `bench comm` measured for `candidate` (None when it did not run or failed)."""
    from outrider.plan.hardware import Link

    if not comm or "candidates" not in comm:
        return None
    for c in comm["candidates"]:
        if c["name"] == candidate and not c["error"]:
            tables = {
                kind: tuple((r["bytes"], r["us"]) for r in c[kind])
                for kind in ("all_reduce", "all_gather")
            }
            return Link(f"measured-{candidate}", measured=tables, world_size=comm["world_size"])
    return None


# -- 3. synthetic acceptance (a torchrun child) ------------------------------------------------


def synthetic_child(tp: int, args: argparse.Namespace) -> dict | None:
    """synthetic_accept.run at TP=tp over the planner's pcie5-nop2p link (the orchestrator sets
    NCCL_P2P_DISABLE=1 in this child's environment)."""
    from synthetic_accept import run

    full = not (args.smoke or args.quick)
    ns = argparse.Namespace(
        model="llama-3.1-8b", curves="0.6,0.8,0.9" if full else "0.8", k=3,
        concurrency=[1, 16, 64] if full else [1, 16], prompt_len=128,
        new_tokens=256 if full else 128, draft_vocab=32000, device="cuda", dtype="bfloat16",
        gpu=None, seed=0, smoke=args.smoke, tensor_parallel_size=tp, link="pcie5-nop2p",
        out_dir=None,
    )  # fmt: skip
    return run(ns)


# -- 5. the drafter on rank 0 against the drafter split (torchrun children) -------------------


def draft_shape(sizes: Sizes) -> dict:
    """The target of the draft part: EAGLE-3's aux layers (2, L//2, L-3) must be distinct for a
    drafter file, which the tiny shape's 4 layers are not."""
    return {**sizes.hf, "num_hidden_layers": 8} if sizes.hf is TINY else sizes.hf


def write_random_drafter(hf: dict, dtype: str, directory: Path) -> Path:
    """A seeded random EAGLE-3 drafter of `hf`'s shape (draft vocabulary: the first
    min(32000, vocab) target ids; time does not depend on the weights) as a drafter directory."""
    from outrider.device import default_dtype
    from outrider.loaders.hf_config import TransformerConfig
    from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
    from outrider.models.eagle3_io import save_drafter

    target = TransformerConfig.from_hf_dict(hf)
    cfg = Eagle3Config.for_target(target, min(32000, target.vocab_size))
    with default_dtype(getattr(torch, dtype)):
        draft = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        draft.d2t.zero_()  # draft id i is target id i
        draft.t2d.zero_()
        draft.t2d[: cfg.draft_vocab_size] = True
    return save_drafter(draft, directory)


class _Vocab:
    """random_checkpoint's tokenizer spells nothing; the drafter's doctor asks its size."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def draft_child(tp: int, sizes: Sizes, draft_tp: int, drafter: str) -> dict | None:
    """Rank 0's chain step times at every (C, k) with the drafter whole on rank 0 (draft_tp 1)
    or split over the ranks (draft_tp = tp); None on ranks > 0."""
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore

    cuda = sizes.device == "cuda"
    hf = draft_shape(sizes)
    top = max(sizes.batch_sizes)
    ks = tuple(k for k in sizes.ks if k > 0)
    cache = {"enable_prefix_caching": False}
    cache |= {"gpu_memory_utilization": 0.5} if cuda else {"num_blocks": 64}
    config = EngineConfig().replace(
        model={"device": sizes.device, "dtype": sizes.dtype, "max_model_len": 1024,
               "cuda_graph_max_batch": top, "cuda_graphs": False},
        cache=cache, scheduler={"max_num_seqs": top},
        speculative={"method": "eagle3", "draft": drafter, "num_draft_tokens": max(ks),
                     "controller": "fixed", "draft_tensor_parallel_size": draft_tp},
        parallel={"tensor_parallel_size": tp},
    )  # fmt: skip
    checkpoint = random_checkpoint(hf, sizes.device, getattr(torch, sizes.dtype))
    checkpoint.tokenizer = _Vocab(hf["vocab_size"])
    t0 = time.perf_counter()
    engine = EngineCore(config, checkpoint)
    start_s = time.perf_counter() - t0
    runner = engine.runner
    points = []
    for b in sizes.batch_sizes:
        for k in (0, *ks):
            runner.reset_collective_counts()
            table = runner.profile_steps([k] if k else [], [b], sizes.reps)
            counts = per_forward(runner.collective_counts())
            points.append({"batch": b, "k": k, "measured_ms": round(table[b][k], 4),
                           "collectives": counts})  # fmt: skip
            print(f"[draft tp={tp} draft_tp={draft_tp}] C={b} k={k}: {table[b][k]:.3f} ms",
                  flush=True)  # fmt: skip
    engine.shutdown()
    return {
        "tp": tp, "draft_tensor_parallel_size": draft_tp, "sharded": runner.drafter.sharded,
        "device_name": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "dtype": sizes.dtype, "cuda_graphs": runner.graphs is not None,
        "engine_start_s": round(start_s, 1), "reps": sizes.reps, "points": points,
    }  # fmt: skip


def draft_part(n: int, sizes: Sizes, args, deadline: float) -> dict:
    """The drafter on rank 0 and split, at TP=n, each in its own torchrun processes."""
    hf = draft_shape(sizes)
    settings = {}
    with tempfile.TemporaryDirectory(prefix="outrider-tp-drafter-") as tmp:
        drafter = write_random_drafter(hf, sizes.dtype, Path(tmp) / "drafter")
        for name, draft_tp in (("drafter on rank 0", 1), ("drafter split", n)):
            if time.monotonic() > deadline - 30:
                settings[name] = {"skipped": "the run's --budget-s was spent"}
                continue
            extra = ["--draft-tp", str(draft_tp), "--drafter", str(drafter)]
            try:
                settings[name] = run_child("draft", n, {}, args, deadline - time.monotonic(),
                                           extra)  # fmt: skip
            except Exception as e:
                settings[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    rows = []
    one, split = (settings[name].get("points") for name in ("drafter on rank 0", "drafter split"))
    if one and split:
        for a, b in zip(one, split, strict=True):
            rows.append({"batch": a["batch"], "k": a["k"], "rank0_ms": a["measured_ms"],
                         "split_ms": b["measured_ms"],
                         "split_over_rank0": round(b["measured_ms"] / a["measured_ms"], 4)})  # fmt: skip
    return {
        "settings": {"shape": "llama-3.1-8b" if sizes.hf is LLAMA_8B else "tiny, 8 layers",
                     "tp": n, "dtype": sizes.dtype, "batch_sizes": sizes.batch_sizes,
                     "ks": sizes.ks, "reps": sizes.reps,
                     "step": "ModelRunner.profile_steps on rank 0: k 0 a plain decode, k >= 1 "
                     "the chain step (verify 1 + k, then k next drafts)",
                     "drafter": "random, one layer of the target's width, draft vocabulary "
                     "min(32000, vocab)", "eager": "cuda_graphs=False in both settings",
                     "ranks_started_by": "torchrun --standalone (weights seeded per rank, the "
                     "drafter read from one directory)"},
        "by_setting": settings,
        "side_by_side": rows,
    }  # fmt: skip


# -- running parts in children -----------------------------------------------------------------


def run_child(
    part: str, tp: int, settings: dict[str, str], args, timeout_s: float, extra_args=()
) -> dict:
    """This script as `--child part` in fresh processes (torchrun for tp > 1) with `settings` in
    their environment (and `extra_args` on the command line); rank 0's result."""
    from outrider import env

    with tempfile.TemporaryDirectory(prefix="outrider-tp-") as tmp:
        out = Path(tmp) / "part.json"
        cmd = [sys.executable]
        if tp > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
        cmd += [__file__, "--child", part, "--tp", str(tp), "--child-out", str(out)]
        cmd += ["--smoke"] * args.smoke + ["--quick"] * args.quick + list(extra_args)
        cmd += ["--model", args.model, "--layers", str(args.layers)]
        extra = {"PYTHONPATH": ":".join(filter(None, [str(HERE.parent), _env_path()]))}
        if args.smoke:
            extra["OUTRIDER_NUM_THREADS"] = "1"  # tiny shapes on shared cores
        # A session of its own: past the timeout torchrun and every rank it started end together
        # (ranks left behind would hold their GPUs through the next part).
        proc = subprocess.Popen(
            cmd, env=env.child_environment({**extra, **settings}), start_new_session=True
        )
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode or not out.is_file():
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} (its log is above)")
        return json.loads(out.read_text())


def _env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def timings(n: int, sizes: Sizes, args, deadline: float) -> dict:
    settings = {}
    for name, tp, extra in (("tp1", 1, {}), (f"tp{n}", n, {}), (f"tp{n}-p2p-off", n, P2P_OFF)):
        if tp == 1 and not fits_one_gpu(sizes):
            settings[name] = {"skipped": "the model does not fit one GPU"}
            continue
        if time.monotonic() > deadline - 30:
            settings[name] = {"skipped": "the run's --budget-s was spent"}
            continue
        try:
            settings[name] = run_child("timings", tp, extra, args, deadline - time.monotonic())
            settings[name]["env"] = extra
            add_break_even(settings[name])
        except Exception as e:
            settings[name] = {"error": f"{type(e).__name__}: {e}"[:500], "env": extra}
    shape = "llama-3.1-8b" if sizes.hf is LLAMA_8B else sizes.hf.get("model_type", "tiny")
    return {
        "settings": {"shape": shape, "layers": sizes.hf["num_hidden_layers"],
                     "dtype": sizes.dtype, "batch_sizes": sizes.batch_sizes, "ks": sizes.ks,
                     "reps": sizes.reps, "step": "ModelRunner.profile_steps on rank 0",
                     "ranks_started_by": "torchrun --standalone (weights seeded per rank)",
                     "graphs": GRAPHS_NOTE},
        "by_setting": settings,
    }  # fmt: skip


def add_break_even(setting: dict) -> None:
    """Each verify point's measured break-even accept length for a proposer that costs nothing
    (n-gram): its verify step over the decode step at the same C."""
    decode = {p["batch"]: p["measured_ms"] for p in setting["points"] if p["k"] == 0}
    for p in setting["points"]:
        if p["k"] and p["batch"] in decode:
            p["break_even_accept_len"] = round(p["measured_ms"] / decode[p["batch"]], 3)


def link_predictions(result: dict, hf: dict) -> None:
    """Planner figures beside every timing point: the built-in link of each setting, and the
    link `bench comm` measured for it once comm has run (its default candidate as is, its
    p2p-off one with P2P off; over gloo the one it has)."""
    from outrider.plan.hardware import load_link

    comm = result["parts"].get("comm")
    nccl = bool(comm) and comm.get("backend") == "nccl"
    for setting in result["parts"]["timings"].get("by_setting", {}).values():
        if "points" not in setting:
            continue
        off = setting.get("env") == P2P_OFF
        builtin = "pcie5-nop2p" if off else "nvlink4"
        label = builtin if setting["tp"] > 1 else "planner"  # one rank: no link
        links = {label: load_link(builtin)}
        measured = measured_link(comm, "p2p-off" if off and nccl else "default")
        if measured is not None and setting["tp"] > 1:
            links["measured"] = measured
        add_predictions(setting, hf, links)


def comm_part(n: int, sizes: Sizes, args, deadline: float) -> dict:
    from outrider.bench.comm import NCCL_CANDIDATES, CommConfig, bench_comm

    elem = 4 if sizes.dtype == "float32" else 2
    names = QUICK_CANDIDATES if args.quick else tuple(NCCL_CANDIDATES)
    left = max(20.0, (deadline - time.monotonic()) / len(names))
    if args.smoke:  # the tiny shape's sizes (no planner model has its width)
        tokens = {b * (1 + k) for b in sizes.batch_sizes for k in sizes.ks}
        width = (sizes.hf["hidden_size"], sizes.hf["vocab_size"])
        cfg = CommConfig(
            world_size=n,
            device="cpu",
            dtype="fp32",
            warmup=2,
            iters=5,
            trials=1,
            sizes=tuple(sorted({w * t * elem for w in width for t in tokens})),
        )
    else:
        cfg = CommConfig(world_size=n, device="cuda", model="llama-3.1-8b", dtype="bf16",
                         batch_sizes=sizes.batch_sizes, ks=sizes.ks, candidates=names,
                         timeout_s=left)  # fmt: skip
    result = bench_comm(cfg)
    result["settings"] = {k: v for k, v in dataclasses.asdict(cfg).items()}
    return result


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=None, help="tensor-parallel size N (default: all)")
    ap.add_argument("--parts", nargs="+", default=None,
                    choices=["equality", "timings", "synthetic", "comm", "draft"],
                    help="default: all; with --model kimi-k2.5, timings and comm")  # fmt: skip
    ap.add_argument(
        "--model",
        default="llama-3.1-8b",
        choices=["llama-3.1-8b", "kimi-k2.5"],
        help="the timed shape (the equality, synthetic and draft parts are Llama's)",
    )
    ap.add_argument("--layers", type=int, default=KIMI.num_layers, help="kimi-k2.5: its first N")
    ap.add_argument("--quick", action="store_true", help="fewer points: a few minutes")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, tiny shapes")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--child", choices=["timings", "synthetic", "draft"], help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--draft-tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--drafter", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    kimi = args.model == "kimi-k2.5"
    if args.parts is None:
        args.parts = ["timings", "comm"] if kimi else ["equality", "timings", "synthetic", "comm",
                                                       "draft"]  # fmt: skip
    llama_only = sorted(set(args.parts) & {"equality", "synthetic", "draft"})
    if kimi and llama_only:
        raise SystemExit(
            f"--parts {' '.join(llama_only)} with --model kimi-k2.5: those parts run the Llama "
            "shape only; use --parts timings comm, or drop --model"
        )
    if not 2 <= args.layers <= KIMI.num_layers:
        raise SystemExit(
            f"--layers {args.layers}: Kimi-K2.5 has {KIMI.num_layers} (1 dense); use 2.."
            f"{KIMI.num_layers}"
        )
    sizes = Sizes.of(args)
    if args.child:
        if args.smoke:
            torch.set_num_threads(1)
        if args.child == "timings":
            result = timings_child(args.tp, sizes)
        elif args.child == "draft":
            result = draft_child(args.tp, sizes, args.draft_tp, args.drafter)
        else:
            result = synthetic_child(args.tp, args)
        if result is not None:  # rank 0
            Path(args.child_out).write_text(json.dumps(result))
        if args.tp > 1:
            from outrider.executor.tp_workers import leave_process

            leave_process(0)
        return

    n = 2 if args.smoke else (args.gpus or torch.cuda.device_count())
    if not args.smoke and (n < 2 or torch.cuda.device_count() < n):
        raise SystemExit(
            f"--gpus {n} with {torch.cuda.device_count()} GPUs here: tensor parallelism needs "
            "2 or more GPUs of this host; pass --gpus N <= the count, or --smoke (the CPU)"
        )
    deadline = time.monotonic() + args.budget_s
    name = ("tp_gpu_kimi" if kimi else "tp_gpu") + ("_smoke" if args.smoke else "")
    result = {"gpus": n, "smoke": args.smoke, "quick": args.quick, "budget_s": args.budget_s,
              "backend": "gloo" if args.smoke else "nccl", "parts": {}}  # fmt: skip
    parts = {
        "equality": lambda: equality(n, sizes),
        "timings": lambda: timings(n, sizes, args, deadline),
        "synthetic": lambda: run_child("synthetic", n, P2P_OFF, args, deadline - time.monotonic()),
        "comm": lambda: comm_part(n, sizes, args, deadline),
        "draft": lambda: draft_part(n, sizes, args, deadline),
    }
    path = None
    for part in args.parts:
        print(f"\n== {part} ==", flush=True)
        if time.monotonic() > deadline - 20:
            result["parts"][part] = {"skipped": f"--budget-s {args.budget_s:g} was spent"}
            continue
        t0 = time.perf_counter()
        try:
            result["parts"][part] = parts[part]()
        except Exception as e:  # report, keep the other parts
            traceback.print_exc()
            result["parts"][part] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        result["parts"][part]["seconds"] = round(time.perf_counter() - t0, 1)
        if part == "synthetic" and "rows" in result["parts"][part]:
            result["parts"][part]["env"] = P2P_OFF
        if "timings" in result["parts"]:
            link_predictions(result, sizes.hf)
        path = write_result(name, result, args.out_dir)
    for part, data in result["parts"].items():
        print(f"\n== {part} ({data.get('seconds', 0):g} s) ==")
        if "error" in data or "skipped" in data:
            print(data.get("error") or data.get("skipped"))
        else:
            TABLES[part](data)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
