"""What the planner knows of a model: its shape (plain data, read from an HF `config.json` or a
built-in table) and how its weights are stored.

Two families cover the built-ins and most checkpoints: Llama-style (grouped-query attention,
dense SwiGLU MLP; Qwen2/3 and Mistral share it) and DeepSeek-V3-style (multi-head latent
attention, MLA, and a mixture of experts, MoE, after `first_k_dense_replace` dense layers;
Kimi-K2 shares it). Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WeightFormat:
    """How one weight element is stored: `bits` per element plus one `scale_bytes` scale per
    `group` elements (0: no scales). int4 group 32 with bf16 scales costs 4/8 + 2/32 = 0.5625
    bytes per element; fp8 with one fp32 scale per 128x128 block costs 1 + 4/16384."""

    name: str
    bits: int
    group: int = 0
    scale_bytes: int = 0

    @property
    def bytes_per_element(self) -> float:
        scales = self.scale_bytes / self.group if self.group else 0.0
        return self.bits / 8 + scales


WEIGHT_FORMATS = {
    "bf16": WeightFormat("bf16", 16),
    "fp32": WeightFormat("fp32", 32),  # the engine on the CPU
    "fp16": WeightFormat("fp16", 16),
    # DeepSeek-V3's released format: e4m3 weights, one fp32 scale per 128x128 block.
    "fp8": WeightFormat("fp8", 8, group=128 * 128, scale_bytes=4),
    # Kimi-K2's released routed experts: symmetric int4, one bf16 scale per 32 weights.
    "int4": WeightFormat("int4", 4, group=32, scale_bytes=2),
    "int4-g128": WeightFormat("int4-g128", 4, group=128, scale_bytes=2),
}


def weight_format(name: str) -> WeightFormat:
    key = name.lower().replace("_", "-").replace("bfloat16", "bf16").replace("float16", "fp16")
    key = key.replace("float32", "fp32")
    key = {"int4-g32": "int4", "w4a16": "int4", "fp8-e4m3": "fp8"}.get(key, key)
    group = key.removeprefix("int4-g")
    if key not in WEIGHT_FORMATS and key.startswith("int4-g") and group.isdigit() and int(group):
        return WeightFormat(key, 4, group=int(group), scale_bytes=2)  # any group size's scales
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shape, as far as cost goes. `q_lora_rank` / `kv_lora_rank` set mean MLA;
    `num_experts` > 0 means MoE layers after the first `first_k_dense` dense ones."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's
    vocab_size: int
    tie_word_embeddings: bool = False
    # MLA (DeepSeek-V2/V3): q through a low-rank bottleneck (0: a plain q projection), K/V
    # cached as one kv_lora_rank latent plus a shared qk_rope_head_dim rotary key per token.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense: int = 0
    # Storage: `weights` for every linear layer, `expert_weights` for routed experts (None:
    # the same as `weights`); the KV cache in kv_bytes per element.
    weights: str = "bf16"
    expert_weights: str | None = None
    kv_bytes: int = 2
    # Measured routing (`with_routing`): per MoE layer, each routed expert's probability that
    # a token chooses it (a row sums to experts_per_token); () prices uniform routing.
    routing: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name!r}: {f}={getattr(self, f)} must be >= 1")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts):
            raise ValueError(
                f"model {self.name!r}: experts_per_token={self.experts_per_token} must be in "
                f"1..num_experts={self.num_experts}"
            )
        weight_format(self.weights)
        weight_format(self.expert_weights or self.weights)
        for row in self.routing:
            if len(row) != self.num_experts or not all(0.0 <= p <= 1.0 for p in row):
                raise ValueError(
                    f"model {self.name!r}: a routing row of {len(row)} probabilities, where "
                    f"{self.num_experts} in [0, 1] (one a routed expert) are needed"
                )

    def with_routing(self, counts: list[list[float]], source: str = "routing") -> ModelSpec:
        """This model priced with measured routing: `counts`, per MoE layer (or one row for
        all of them), how many times each routed expert was chosen. Each row becomes each
        expert's share of the choices times experts_per_token (a token's chance of choosing
        it); `source` names the counts in errors."""
        if not self.moe:
            raise ValueError(f"{source}: {self.name} has no routed experts to route")
        rows = []
        for i, row in enumerate(counts):
            if (
                not isinstance(row, list)
                or len(row) != self.num_experts
                or not all(isinstance(c, (int, float)) and c >= 0 for c in row)
                or not sum(row)
            ):
                raise ValueError(
                    f"{source}: layer {i} must be {self.num_experts} counts >= 0 (one for each "
                    f"of {self.name}'s routed experts), not all zero"
                )
            total = float(sum(row))
            rows.append(tuple(min(1.0, self.experts_per_token * c / total) for c in row))
        if len(rows) not in (1, self.num_moe_layers):
            raise ValueError(
                f"{source}: {len(rows)} layers of counts, where {self.name} has "
                f"{self.num_moe_layers} MoE layers: give one row for each, or one for all"
            )
        return dataclasses.replace(self, routing=tuple(rows))

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.moe else 0

    def with_weights(self, weights: str | None = None, expert_weights: str | None = None):
        """This model stored another way (None keeps a field as it is)."""
        return dataclasses.replace(
            self,
            weights=weights or self.weights,
            expert_weights=expert_weights or self.expert_weights,
        )

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel size the model's heads or MLP do not split over."""
        if tp < 1:
            raise ValueError(f"invalid --tp {tp}: use an integer >= 1")
        fits = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
        if self.num_heads % tp:
            raise ValueError(
                f"--tp {tp} does not divide {self.name}'s num_attention_heads={self.num_heads}: "
                f"use one of {', '.join(map(str, fits))}"
            )
        kv = self.num_kv_heads
        if not self.mla and kv % tp and tp % kv:
            raise ValueError(
                f"--tp {tp} neither divides nor is a multiple of {self.name}'s "
                f"num_key_value_heads={kv}: use a tp that divides {kv} or a multiple of it"
            )
        for f in ("intermediate_size", "moe_intermediate_size"):
            size = getattr(self, f)
            if size and size % tp:
                raise ValueError(f"--tp {tp} does not divide {self.name}'s {f}={size}")


# Built-in shapes, from each model's released config.json (HF hub: HuggingFaceTB/
# SmolLM2-135M-Instruct, meta-llama/Llama-3.1-8B-Instruct, deepseek-ai/DeepSeek-V3,
# moonshotai/Kimi-K2.5's text_config).
_DEEPSEEK_MLA = dict(
    num_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, experts_per_token=8, num_shared_experts=1,
)  # fmt: skip
BUILTIN = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256,
    ),
    "deepseek-v3": ModelSpec(
        "deepseek-v3", num_heads=128, num_kv_heads=128, head_dim=192, vocab_size=129280,
        num_experts=256, first_k_dense=3, weights="fp8", **_DEEPSEEK_MLA,
    ),
    # Routed experts in int4 (group 32, bf16 scales), everything else bf16, as released.
    "kimi-k2.5": ModelSpec(
        "kimi-k2.5", num_heads=64, num_kv_heads=64, head_dim=192, vocab_size=163840,
        num_experts=384, first_k_dense=1, weights="bf16", expert_weights="int4",
        **_DEEPSEEK_MLA,
    ),
}  # fmt: skip
ALIASES = {
    "smollm2": "smollm2-135m",
    "llama-8b": "llama-3.1-8b",
    "llama3.1-8b": "llama-3.1-8b",
    "deepseek-r1": "deepseek-v3",
    "kimi-k2": "kimi-k2.5",
    "kimi-k2-thinking": "kimi-k2.5",
}

# The fields a config.json needs, by what the planner reads them for.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def from_hf_dict(d: dict[str, Any], name: str = "config.json") -> ModelSpec:
    """A ModelSpec from an HF config dict (a multimodal config's `text_config` is read)."""
    if isinstance(d.get("text_config"), dict):
        d = {**d["text_config"], "quantization_config": d.get("quantization_config")}
    missing = [f for f in REQUIRED if not isinstance(d.get(f), int)]
    n_experts = d.get("n_routed_experts") or d.get("num_experts") or d.get("num_local_experts")
    inter = d.get("intermediate_size")
    if not isinstance(inter, int) and not (n_experts and d.get("moe_intermediate_size")):
        missing.append("intermediate_size")
    if missing:
        raise ValueError(
            f"{name} lacks {', '.join(missing)}, which the planner needs: pass the model's own "
            f"config.json (for a multimodal model, one with a text_config) or a built-in name "
            f"({', '.join(BUILTIN)})"
        )
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    weights, expert_weights = _formats(d.get("quantization_config"))
    mla = bool(d.get("kv_lora_rank"))
    moe_inter = d.get("moe_intermediate_size") or 0
    return ModelSpec(
        name=str(d.get("_name_or_path") or name),
        hidden_size=hidden,
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads if mla else (d.get("num_key_value_heads") or heads),
        head_dim=d.get("head_dim") or hidden // heads,
        intermediate_size=inter if isinstance(inter, int) else moe_inter,
        vocab_size=d["vocab_size"],
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        q_lora_rank=d.get("q_lora_rank") or 0,
        kv_lora_rank=d.get("kv_lora_rank") or 0,
        qk_nope_head_dim=d.get("qk_nope_head_dim") or 0,
        qk_rope_head_dim=d.get("qk_rope_head_dim") or 0,
        v_head_dim=d.get("v_head_dim") or 0,
        num_experts=n_experts or 0,
        experts_per_token=(d.get("num_experts_per_tok") or 0) if n_experts else 0,
        num_shared_experts=(d.get("n_shared_experts") or 0) if n_experts else 0,
        moe_intermediate_size=moe_inter if n_experts else 0,
        first_k_dense=(d.get("first_k_dense_replace") or 0) if n_experts else 0,
        weights=weights,
        expert_weights=expert_weights,
    )


def _formats(q: Any) -> tuple[str, str | None]:
    """(weights, expert_weights) from an HF quantization_config: fp8 block quantization, or
    compressed-tensors int4 (Kimi-K2's experts). Anything else reads as bf16."""
    if not isinstance(q, dict):
        return "bf16", None
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8", None
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w.get("num_bits") == 4:
                group = w.get("group_size") or 32
                return "bf16", "int4" if group == 32 else f"int4-g{group}"
    return "bf16", None


def read_routing(path: str) -> list[list[float]]:
    """The per-layer counts of a routing file (`outrider bench routing` writes one): a JSON
    object whose "layers" holds, for each MoE layer, how many times each routed expert was
    chosen."""
    p = Path(path).expanduser()
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"--routing {path!r}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--routing {path!r} is not valid JSON ({e})") from None
    layers = d.get("layers") if isinstance(d, dict) else None
    if not isinstance(layers, list) or not layers:
        raise ValueError(
            f'--routing {path!r}: expected a JSON object with "layers", a list of each MoE '
            "layer's counts of choices per routed expert (what `outrider bench routing` writes)"
        )
    return layers


def load_model(model: str) -> ModelSpec:
    """A built-in name (`outrider plan --help` lists them), a config.json, or a directory
    holding one."""
    key = model.strip().lower()
    key = ALIASES.get(key, key)
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.parent != Path("."):
        if not path.is_file():
            raise ValueError(
                f"no config.json at {str(path)!r}: pass a model directory that holds one, a "
                f"config.json, or a built-in name ({', '.join(BUILTIN)})"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e}): pass the model's config.json"
            ) from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} holds no JSON object: pass the model's config.json")
        return from_hf_dict(d, name=str(path))
    near = difflib.get_close_matches(key, [*BUILTIN, *ALIASES], n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown model {model!r}: {hint}use a built-in name ({', '.join(BUILTIN)}), a "
        "config.json or a model directory"
    )
