"""Per-layer step times of Kimi-K2.5 on one GPU, measured on a few of its layers with random
weights, beside the planner's per-layer prediction.

    python benchmarks/kimi_layers.py [--layers 4] [--batches 1 16 64] [--ks 0 3 7] [--reps 5]
                                     [--gpu h200] [--out-dir DIR]
    python benchmarks/kimi_layers.py --smoke --out-dir /tmp/kimi   # tiny, CPU, seconds

The model: Kimi-K2.5's text model at its real dimensions (the planner's built-in "kimi-k2.5"
row: hidden 7168, 64 heads, MLA ranks q 1536 / kv 512, rope 64, nope 128, v 128, 384 routed
experts of width 2048, 8 per token, 1 shared expert, vocabulary 163840) with routed experts in
INT4 as released (compressed-tensors pack-quantized, group 32, bf16 scales) and everything else
bf16, but only --layers layers. Weights are random and made on the device tensor by tensor
(step time does not depend on their values; no checkpoint file, nothing passes through host
memory: each tensor is copied on the device into its parameter). 3 MoE layers are ~25 GB.

What is timed: the engine's step as profile_steps times it (ModelRunner.run for decode, k = 0;
run_spec for the verify step of 1 + k tokens per sequence: inputs built, CUDA graphs replayed
where the model has them, else eager, the host read of the sampled tokens included), median of
--reps after a warm-up, every row in an empty cache (context 0, the scratch block). One
difference from profile_steps: each row holds its own random tokens. profile_steps fills every
row with token 0, so every row routes to the same 8 experts, where a real batch of N tokens
reads U(N) = E(1 - (1 - 8/E)^N) of them (284 of 384 at N = 64), which is what the planner
prices.

Per layer, by differences of whole steps at three layer counts, so that the embedding, the LM
head, sampling, acceptance and per-step launch costs cancel:

    MoE layer   = (t(N layers: 1 dense + N-1 MoE) - t(1 dense layer)) / (N - 1)
    dense layer =  t(2 dense layers) - t(1 dense layer)

The two small models (one or two dense layers, ~6 GB) are cheap to build; only the N-layer
one holds experts. The prediction is the same difference of the planner's whole-step times
(plan/calibrate.py predict_ms: costmodel's decode and verify sums at context 0, one rank, the
GPU profile given) for models of those layer counts. Taking the difference rather than pricing
one layer's kernels alone keeps the two sides alike: an eager step is priced at no less than
its launches times the host's time per launch, a bound that holds for the whole step and not
for a layer, and the difference carries it exactly as the measurement does. Error is
predicted / measured - 1.

Writes benchmarks/results/kimi_layers.json (--smoke: kimi_layers_smoke.json; --out-dir: another
folder) with whether CUDA graphs were used, per model and step kind: on CUDA, DeepSeek-V3
models replay graphs where their MoE takes the fused path (steps of at most 1024 tokens) and the
prediction is then the graphed one; elsewhere every step runs eagerly and is priced so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from gpu_decode import _NullTokenizer  # noqa: E402

from outrider.plan.hardware import Gpu  # noqa: E402
from outrider.plan.models import BUILTIN, ModelSpec  # noqa: E402

KIMI = BUILTIN["kimi-k2.5"]
# A tiny model of the same family for --smoke: MLA, INT4 experts of group 32, a shared expert.
SMOKE = dataclasses.replace(
    KIMI, name="kimi-smoke", hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=24,
    intermediate_size=96, vocab_size=256, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_experts=8, experts_per_token=2,
    moe_intermediate_size=64,
)  # fmt: skip
GROUP = 32  # INT4 scale group, as Kimi ships its experts
# How Kimi-K2.5's config.json says its routed experts are stored (loaders/compressed_tensors.py).
INT4_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": GROUP, "actorder": None},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
STD = 0.02  # random weights' scale: keeps activations finite through a few layers


def hf_config(spec: ModelSpec, layers: int, dense: int) -> dict:
    """config.json of `spec`'s text model as DeepseekV3ForCausalLM, cut to `layers` layers of
    which the first `dense` are dense. Router and rotary settings are Kimi-K2's released ones
    (sigmoid scores, one expert group, YaRN x64); none of them changes a step's time."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": layers, "first_k_dense_replace": dense,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_heads,
        "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim, "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.num_shared_experts,
        "num_experts_per_tok": spec.experts_per_token, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
        "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "quantization_config": INT4_QUANT,
    }  # fmt: skip


@contextlib.contextmanager
def shared_expert_storage():
    """Inside: every Int4FusedExperts built holds the same four routed-expert tensors as the
    first one of its shape, so the whole depth of Kimi-K2.5 (60 MoE layers of 8.5 GB of INT4
    experts each) fits one GPU with ~9 GB of experts. A step reads what the real model's does:
    each layer reads the experts it routes to, and a layer's 8 (of 384) are rarely the ones
    the layer before read, with hundreds of MB of other weights between (L2 is 50 MB). Step
    time does not depend on the values (random anyway); each layer's load writes the shared
    tensors again."""
    from torch import nn

    from outrider.layers.moe import Int4FusedExperts

    built = Int4FusedExperts.__init__
    shared: dict[tuple, nn.Parameter] = {}

    def init(self, *args, **kwargs):
        device = torch.get_default_device()
        with torch.device("meta"):
            built(self, *args, **kwargs)
        for name, param in list(self.named_parameters(recurse=False)):
            key = (name, tuple(param.shape), param.dtype, device)
            if key not in shared:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                shared[key] = nn.Parameter(empty, requires_grad=False)
            vars(shared[key]).update(vars(param))  # weight_loader, expected_shards
            setattr(self, name, shared[key])

    Int4FusedExperts.__init__ = init
    try:
        yield
    finally:
        Int4FusedExperts.__init__ = built


def random_checkpoint(
    hf: dict,
    device: str,
    dtype: torch.dtype,
    residual_write_scale: float = 1.0,
    tied_head: bool = False,
    share_experts: bool = False,
):
    """A Checkpoint of `hf`'s shape whose iter_tensors makes each HF-named tensor on `device`
    when asked: unquantized weights N(0, STD) in `dtype` (norms 1), routed experts as
    compressed-tensors INT4 (random int32 words of 8 nibbles, bf16 scales per 32 inputs) where
    `hf` has a quantization_config, else like the rest. Without q_lora_rank the queries come
    from one q_proj (Moonlight, DeepSeek-V2-Lite). The layers' writes into the residual stream
    (o_proj, every down projection: dense, shared, routed, INT4 scales) are
    `residual_write_scale` times that; `tied_head`: the LM head's rows are the embedding's (its
    own tensor still), as synthetic_accept.py's Llama shapes. `share_experts`: every INT4
    routed expert of a shape is made once and handed out for all of them (the loads behind
    shared_expert_storage write one tensor each time; making 60 x 1152 of them would take
    minutes)."""
    from outrider.loaders.checkpoint import Checkpoint
    from outrider.loaders.hf_config import config_from_hf

    h, inter, moe = hf["hidden_size"], hf["intermediate_size"], hf["moe_intermediate_size"]
    heads, vocab, experts = hf["num_attention_heads"], hf["vocab_size"], hf["n_routed_experts"]
    q_lora, lora, rope = hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    nope, v = hf["qk_nope_head_dim"], hf["v_head_dim"]
    shared = moe * hf["n_shared_experts"]
    quantized = hf.get("quantization_config") is not None

    class _Random:
        def iter_tensors(self):
            g = torch.Generator(device=device).manual_seed(0)

            def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
                return torch.randn(shape, device=device, dtype=dtype, generator=g) * STD * scale

            def ones(n: int) -> torch.Tensor:
                return torch.ones(n, device=device, dtype=dtype)

            made: dict[tuple, dict[str, torch.Tensor]] = {}

            def int4(out: int, inp: int, factor: float = 1.0) -> dict[str, torch.Tensor]:
                if share_experts:
                    if (out, inp, factor) not in made:
                        made[out, inp, factor] = make_int4(out, inp, factor)
                    return made[out, inp, factor]
                return make_int4(out, inp, factor)

            def make_int4(out: int, inp: int, factor: float) -> dict[str, torch.Tensor]:
                # Uniform nibbles: q in [-8, 7], std ~4.6; scales ~STD / 4.6 keep W ~ STD.
                words = torch.randint(-(2**31), 2**31 - 1, (out, inp // 8), dtype=torch.int32,
                                      device=device, generator=g)  # fmt: skip
                scale = (
                    torch.rand(out, inp // GROUP, device=device, generator=g) * STD * factor / 2.3
                )
                shape = torch.tensor([out, inp], device=device)
                return {"weight_packed": words, "weight_scale": scale.to(torch.bfloat16),
                        "weight_shape": shape}  # fmt: skip

            write = residual_write_scale
            embedding = normal(vocab, h)
            yield "model.embed_tokens.weight", embedding
            for i in range(hf["num_hidden_layers"]):
                p = f"model.layers.{i}."
                yield p + "input_layernorm.weight", ones(h)
                yield p + "post_attention_layernorm.weight", ones(h)
                a = p + "self_attn."
                if q_lora:
                    yield a + "q_a_proj.weight", normal(q_lora, h)
                    yield a + "q_a_layernorm.weight", ones(q_lora)
                    yield a + "q_b_proj.weight", normal(heads * (nope + rope), q_lora)
                else:
                    yield a + "q_proj.weight", normal(heads * (nope + rope), h)
                yield a + "kv_a_proj_with_mqa.weight", normal(lora + rope, h)
                yield a + "kv_a_layernorm.weight", ones(lora)
                yield a + "kv_b_proj.weight", normal(heads * (nope + v), lora)
                yield a + "o_proj.weight", normal(h, heads * v, scale=write)
                mlp = p + "mlp."
                if i < hf["first_k_dense_replace"]:
                    yield mlp + "gate_proj.weight", normal(inter, h)
                    yield mlp + "up_proj.weight", normal(inter, h)
                    yield mlp + "down_proj.weight", normal(h, inter, scale=write)
                    continue
                yield mlp + "gate.weight", normal(experts, h)
                # Zero correction bias: random hidden states then route near-uniformly.
                bias = torch.zeros(experts, device=device, dtype=torch.float32)
                yield mlp + "gate.e_score_correction_bias", bias
                for e in range(experts):
                    for part, (out, inp) in (("gate", (moe, h)), ("up", (moe, h)),
                                             ("down", (h, moe))):  # fmt: skip
                        name = f"{mlp}experts.{e}.{part}_proj."
                        scale = write if part == "down" else 1.0
                        if not quantized:
                            yield name + "weight", normal(out, inp, scale=scale)
                            continue
                        for kind, t in int4(out, inp, scale).items():
                            yield name + kind, t
                yield mlp + "shared_experts.gate_proj.weight", normal(shared, h)
                yield mlp + "shared_experts.up_proj.weight", normal(shared, h)
                yield mlp + "shared_experts.down_proj.weight", normal(h, shared, scale=write)
            yield "model.norm.weight", ones(h)
            yield "lm_head.weight", embedding if tied_head else normal(vocab, h)

    return Checkpoint(Path("random"), "random", hf, config_from_hf(hf), _NullTokenizer(), _Random())


def build_runner(checkpoint, device: str, dtype: str, ks: tuple[int, ...], max_batch: int):
    """A ModelRunner as calibrate.measure_checkpoint builds one, graphs captured where the
    model allows them, with a KV pool of a few blocks (every timed row writes the scratch
    block only)."""
    from outrider.config import EngineConfig
    from outrider.executor.model_runner import ModelRunner

    spec_ks = tuple(sorted({k for k in ks if k > 0})) or (1,)
    config = EngineConfig.from_dict({
        "model": {"model": "random", "device": device, "dtype": dtype, "max_model_len": 4096,
                  "cuda_graph_max_batch": max_batch},
        "cache": {"num_blocks": 8},
        "speculative": {"method": "ngram", "num_draft_tokens": max(spec_ks)},
    })  # fmt: skip
    runner = ModelRunner(config, checkpoint)
    runner.set_speculation(None, spec_ks)
    runner.capture_graphs()
    return runner


def time_steps(
    runner, batches: tuple[int, ...], ks: tuple[int, ...], reps: int, seed: int = 0
) -> dict[tuple[int, int], float]:
    """{(batch, k): median ms of one step}, as ModelRunner.profile_steps times it but with
    random tokens in every row (see the module's docstring)."""
    from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
    from outrider.speculative.base import SeqDrafts

    if max(ks) + 1 > runner.block_size:
        raise ValueError(
            f"k={max(ks)}: a row of 1 + k tokens must fit the one scratch block of "
            f"{runner.block_size} tokens; use k <= {runner.block_size - 1}"
        )
    params = SamplingParams(temperature=0, max_tokens=None)
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    table = {}
    for b in batches:
        for k in ks:
            rows = torch.randint(0, vocab, (b, 1 + k), generator=g).tolist()
            seqs = [
                ScheduledSeq(Request(prompt_token_ids=row[:1], params=params), row, 0,
                             [runner.num_blocks], True, SeqDrafts.chain(row[1:]) if k else None)
                for row in rows
            ]  # fmt: skip
            batch = ScheduledBatch(ForwardMode.VERIFY if k else ForwardMode.DECODE, seqs)
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                if k:
                    runner.run_spec(batch, k, 0)  # CPU-GPU sync point: the accepted tokens
                else:
                    runner.run(batch)  # CPU-GPU sync point: the sampled tokens
                if i:  # the first one warms up
                    times.append((time.perf_counter() - t0) * 1e3)
            table[(b, k)] = sorted(times)[len(times) // 2]
    return table


def measure_layers(
    spec: ModelSpec,
    layers: int,
    batches: tuple[int, ...],
    ks: tuple[int, ...],
    reps: int,
    device: str,
    dtype: str,
    gpu: Gpu,
) -> dict:
    """Build, time and free the three models (1 dense layer, 2 dense layers, `layers` layers
    with experts after the first) and derive the per-layer rows (the module's docstring)."""
    from outrider.plan import calibrate
    from outrider.plan.models import from_hf_dict

    if layers < 2:
        raise ValueError(f"--layers {layers}: the MoE layer is derived from >= 2 layers")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    weights = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    ks = tuple(sorted(set(ks)))
    models = {"dense1": (1, 1), "dense2": (2, 2), f"moe{layers}": (layers, 1)}
    steps, graphs, built, priced = {}, {}, {}, {}
    for name, (n, dense) in models.items():
        hf = hf_config(spec, n, dense)
        t0 = time.perf_counter()
        runner = build_runner(random_checkpoint(hf, device, torch_dtype), device, dtype, ks,
                              max(batches))  # fmt: skip
        built[name] = {"layers": n, "dense_layers": dense,
                       "build_s": round(time.perf_counter() - t0, 2),
                       "attention_backend": runner.backend.name}  # fmt: skip
        # Weights made on the device reach their parameters there: the host's peak stays far
        # below the model's size (ru_maxrss is in KiB on Linux).
        built[name]["host_peak_rss_gb"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2
        )
        if runner.device.type == "cuda":
            built[name]["gpu_memory_gb"] = round(
                torch.cuda.memory_allocated(runner.device) / 1e9, 2
            )
        graphs[name] = {"decode": runner.graphs is not None,
                        "verify": bool(runner.spec_step.graphs)}  # fmt: skip
        measured = time_steps(runner, tuple(batches), ks, reps)
        model = priced[name] = dataclasses.replace(
            from_hf_dict(hf, name=name), weights=weights, kv_bytes=torch_dtype.itemsize
        )
        steps[name] = []
        for (b, k), ms in measured.items():
            point = calibrate.Point(b, k, ms)
            graphed = graphs[name]["verify" if k else "decode"]
            predicted = calibrate.predict_ms(model, gpu, point, graphed)
            steps[name].append({"batch": b, "k": k, "measured_ms": ms, "predicted_ms": predicted})
        built[name]["total_s"] = round(time.perf_counter() - t0, 2)
        print(f"{name}: built in {built[name]['build_s']:.1f} s, measured in "
              f"{built[name]['total_s'] - built[name]['build_s']:.1f} s", flush=True)  # fmt: skip
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    moe = f"moe{layers}"
    rows = per_layer(steps, moe, layers)
    return {
        "model": spec.name,
        "layers": layers,
        # What the planner priced for the MoE model (the others differ in layers only).
        "planner_model": dataclasses.asdict(priced[moe]),
        "device": device,
        "dtype": dtype,
        "gpu_profile": dataclasses.asdict(gpu),
        "cuda_graphs": graphs,
        "models": built,
        "derivation": {
            "moe_layer": f"(t({moe}) - t(dense1)) / {layers - 1}",
            "dense_layer": "t(dense2) - t(dense1)",
            "routing": "random tokens per row (near-uniform over the experts)",
        },
        "per_layer": rows,
        "steps": {name: [_rounded(r) for r in rs] for name, rs in steps.items()},
    }


def per_layer(steps: dict[str, list[dict]], moe: str, layers: int) -> list[dict]:
    """Measured and predicted milliseconds of one MoE and one dense layer at each (batch, k)."""

    def at(name: str, key: str) -> dict[tuple[int, int], float]:
        return {(r["batch"], r["k"]): r[key] for r in steps[name]}

    rows = []
    for b, k in at("dense1", "measured_ms"):
        row: dict = {"batch": b, "k": k, "tokens": b * (1 + k)}
        for label, ms in (("measured", "measured_ms"), ("predicted", "predicted_ms")):
            one, two, many = at("dense1", ms), at("dense2", ms), at(moe, ms)
            row[f"moe_layer_{label}_ms"] = (many[(b, k)] - one[(b, k)]) / (layers - 1)
            row[f"dense_layer_{label}_ms"] = two[(b, k)] - one[(b, k)]
        for kind in ("moe_layer", "dense_layer"):
            measured = row[f"{kind}_measured_ms"]
            # A difference of medians can come out <= 0 where a layer is within the noise.
            row[f"{kind}_error"] = (
                row[f"{kind}_predicted_ms"] / measured - 1 if measured > 0 else None
            )
        rows.append(_rounded(row))
    return rows


def _rounded(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def table(result: dict) -> str:
    """C, k, measured and predicted ms per layer, error."""
    graphed = [g for gs in result["cuda_graphs"].values() for g in gs.values()]
    mode = "CUDA graphs" if all(graphed) else "eager" if not any(graphed) else "graphs in part"
    lines = [
        f"{result['model']}, {result['layers']} layers, {result['device']} {result['dtype']}, "
        f"{mode}, profile {result['gpu_profile']['name']}",
        f"{'C':>4} {'k':>3} {'MoE ms':>9} {'pred':>9} {'err':>7}   "
        f"{'dense ms':>9} {'pred':>9} {'err':>7}",
    ]

    def err(e: float | None) -> str:
        return f"{e:>+7.0%}" if e is not None else f"{'-':>7}"

    for r in result["per_layer"]:
        lines.append(
            f"{r['batch']:>4} {r['k']:>3} {r['moe_layer_measured_ms']:>9.3f} "
            f"{r['moe_layer_predicted_ms']:>9.3f} {err(r['moe_layer_error'])}   "
            f"{r['dense_layer_measured_ms']:>9.3f} {r['dense_layer_predicted_ms']:>9.3f} "
            f"{err(r['dense_layer_error'])}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4, help="the MoE model's layers (1 dense)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 3, 7])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gpu", default=None,
                    help="GPU profile to predict with: a built-in name or a JSON file (default: "
                         "the CUDA device's built-in row)")  # fmt: skip
    ap.add_argument("--out-dir", default=None, help="where kimi_layers.json goes")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model of the same family on the CPU in fp32, seconds")  # fmt: skip
    args = ap.parse_args()

    from outrider.plan import calibrate
    from outrider.plan.cli import _gpu_by_name
    from outrider.plan.hardware import load_gpu

    if args.smoke:
        spec, device, dtype = SMOKE, "cpu", "float32"
        gpu = calibrate.cpu_profile(torch.get_num_threads(), calibrate._host_memory_gb())
    else:
        if not torch.cuda.is_available():
            raise SystemExit("kimi_layers measures a GPU: run it where CUDA is, or pass --smoke")
        spec, device, dtype = KIMI, "cuda", "bfloat16"
        gpu = load_gpu(args.gpu) if args.gpu else _gpu_by_name(torch.cuda.get_device_name())
    if args.gpu and args.smoke:
        gpu = load_gpu(args.gpu)
    t0 = time.perf_counter()
    result = measure_layers(spec, args.layers, tuple(args.batches), tuple(args.ks), args.reps,
                            device, dtype, gpu)  # fmt: skip
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(table(result))
    name = "kimi_layers_smoke" if args.smoke else "kimi_layers"
    path = write_result(name, result, args.out_dir)
    print(f"wrote {path} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
