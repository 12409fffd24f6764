"""The network's shape, read from an HF `config.json` dict (GGUF metadata is mapped to the same
dict first, so both checkpoint formats meet here). `config_from_hf` picks the config class by
architecture: the one its model (models/registry.py, by the same names) declares as its
`config_class`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.loaders.compressed_tensors import Int4Scheme, parse_quantization_config, split_unit
from outrider.loaders.fp8_blocks import Fp8BlockScheme, is_fp8, parse_fp8_config
from outrider.loaders.vocab_common import read_json


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str  # HF architecture name, the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF form, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on per-head q and k before rotary (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # FP8 block-quantized weights (quantization_config quant_method "fp8"), dequantized as
    # they load (Checkpoint.iter_tensors); None when stored unquantized.
    fp8_blocks: Fp8BlockScheme | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: the checkpoint's config is broken"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported: only 'silu' is")

    @property
    def aux_hidden_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's capture points: the residual stream *entering* layers 2, L//2 and L-3,
        i.e. HF `hidden_states[i]` for these i (hidden_states[0] is the embedding output)."""
        n = self.num_hidden_layers
        return (2, n // 2, n - 3)

    @property
    def eagle3_draft_layer(self) -> dict[str, Any]:
        """The EAGLE-3 draft layer's shape for this target (Eagle3Config fields): the target's
        own heads, MLP width and rotary."""
        return {
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        arch = resolve_architecture(d)
        heads = _positive(d, "num_attention_heads")
        hidden = _positive(d, "hidden_size")
        rope = d.get("rope_parameters") or d.get("rope_scaling")  # transformers 5 / 4 spelling
        rope_theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        quant = d.get("quantization_config")
        try:  # FP8 blocks load; other quantization is not read here (GGUF's is dequantized)
            fp8_blocks = parse_fp8_config(quant) if is_fp8(quant) else None
        except ValueError as e:
            raise ValueError(f"{arch}: {e}") from None
        return cls(
            architecture=arch,
            vocab_size=_positive(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive(d, "intermediate_size"),
            num_hidden_layers=_positive(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_positive(d, "num_key_value_heads", heads),
            head_dim=_positive(d, "head_dim", hidden // heads),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=_positive(d, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            fp8_blocks=fp8_blocks,
        )


def _positive(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """config.json's `key`, a positive integer (`default` when it is missing, null or 0)."""
    value = d.get(key) or default
    if value is None:
        raise ValueError(f"the config lacks {key!r}: the checkpoint's config.json is incomplete")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"the config's {key} is {value!r:.80}, expected a positive integer: the "
            "checkpoint's config.json is corrupt"
        )
    return value


# DeepSeek-V3 keys with no default we could guess without changing the model's math.
_DEEPSEEK_REQUIRED = {
    "vocab_size": "the vocabulary size",
    "hidden_size": "the residual width",
    "intermediate_size": "the dense layers' MLP width",
    "moe_intermediate_size": "each routed expert's MLP width",
    "num_hidden_layers": "the layer count",
    "num_attention_heads": "the attention heads",
    "q_lora_rank": "the query low-rank width (null for a plain q_proj)",
    "kv_lora_rank": "the cached latent's width",
    "qk_nope_head_dim": "the per-head query/key width without rotary",
    "qk_rope_head_dim": "the per-head rotary width",
    "v_head_dim": "the per-head value width",
    "n_routed_experts": "the routed experts per MoE layer",
    "n_shared_experts": "the shared experts per MoE layer",
    "num_experts_per_tok": "the experts each token is routed to",
    "n_group": "the expert groups of the router",
    "topk_group": "the groups each token may pick experts from",
    "first_k_dense_replace": "how many leading layers are dense",
    "routed_scaling_factor": "the routed experts' output scale",
    "norm_topk_prob": "whether the chosen experts' weights are renormalised",
}
# Those of them that are sizes or counts (q_lora_rank may be null, the rest 0).
_DEEPSEEK_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
    "topk_group",
)  # fmt: skip


@dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3 (and Kimi-K2, which reuses the architecture): multi-head latent attention
    with a latent KV cache, and a stack of dense layers then routed-MoE layers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "yarn", "factor": 40, ...}
    rope_interleave: bool = True  # rotary pairs (2i, 2i + 1) rather than (i, i + d / 2)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Checkpoint names carry this prefix when the text model sits inside a multimodal one
    # (Kimi-K2.5: "language_model.model.layers...").
    weight_prefix: str = ""
    # INT4 routed experts (compressed-tensors pack-quantized, Kimi-K2's release format); None
    # when the checkpoint is unquantized. Everything else is always stored unquantized.
    expert_quant: Int4Scheme | None = None
    # FP8 block-quantized weights (DeepSeek-V3's release format), dequantized as they load
    # (Checkpoint.iter_tensors). Never together with expert_quant: one quantization_config.
    fp8_blocks: Fp8BlockScheme | None = None
    sliding_window: int | None = None  # never set: the engine reads it for every model

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported: only 'silu' is")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.n_routed_experts} does not split into n_group="
                f"{self.n_group} equal groups: the checkpoint's config is broken"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"topk_group={self.topk_group} must be within 1..n_group={self.n_group}"
            )
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                f"{self.topk_group * per_group} experts in topk_group={self.topk_group} groups"
            )
        if per_group < 2:
            raise ValueError(
                f"{per_group} expert per group: the router scores a group by its best two "
                f"experts, so n_routed_experts / n_group must be >= 2"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when rope is YaRN
        (DeepSeek scales the logits, not only cos/sin, for the longer context)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_scaling or {}
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        if rope.get("rope_type", rope.get("type", "default")) != "default" and mscale_all_dim:
            factor = rope["factor"]
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    @property
    def aux_hidden_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's capture points, as TransformerConfig's: the residual stream entering
        layers 2, L//2 and L-3 (HF hidden_states[i])."""
        n = self.num_hidden_layers
        return (2, n // 2, n - 3)

    @property
    def eagle3_draft_layer(self) -> dict[str, Any]:
        """The EAGLE-3 draft layer's shape for this target (Eagle3Config fields). The draft
        layer is Llama-style multi-head attention, not MLA, as in the published Kimi-K2
        drafters (SpecForge's: 64 query and 64 KV heads of 128 = v_head_dim, the dense
        layers' MLP width, no rope scaling): the target's heads with v_head_dim-wide heads."""
        return {
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.v_head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV3Config:
        """config.json of DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2), or of a multimodal
        wrapper that nests it as `text_config` (Kimi-K2.5); top-level end ids win."""
        arch = resolve_architecture(d)
        text = d.get("text_config")
        prefix = ""
        if isinstance(text, dict):
            prefix = "language_model."
            text = {**text, **{k: d[k] for k in ("eos_token_id", "bos_token_id") if k in d}}
        else:
            text = d
        quant = d.get("quantization_config") or text.get("quantization_config")
        try:  # FP8 blocks and INT4 routed experts load; other quantization is refused by name
            fp8_blocks = parse_fp8_config(quant) if is_fp8(quant) else None
            expert_quant = parse_quantization_config(quant) if quant and not fp8_blocks else None
        except ValueError as e:
            raise ValueError(f"{arch}: {e}") from None
        missing = [k for k in _DEEPSEEK_REQUIRED if k not in text]
        if missing:
            what = ", ".join(f"{k!r} ({_DEEPSEEK_REQUIRED[k]})" for k in missing)
            raise ValueError(
                f"the {arch} config lacks {what}: the checkpoint's config.json is incomplete; "
                f"copy the field(s) from the model's published config.json"
            )
        for key in _DEEPSEEK_SIZES:
            _positive(text, key)
        rope = text.get("rope_parameters") or text.get("rope_scaling")
        rope_theta = text.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if text.get(key, want) != want:
                raise ValueError(
                    f"{key}={text[key]!r} is not supported: the DeepSeek-V3 router is {want!r}"
                )
        if text.get("moe_layer_freq", 1) != 1:
            raise ValueError(
                f"moe_layer_freq={text['moe_layer_freq']} is not supported: DeepSeek-V3 puts "
                f"an MoE in every layer after first_k_dense_replace (moe_layer_freq 1)"
            )
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            **{k: text[k] for k in _DEEPSEEK_REQUIRED},
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope else None,
            rope_interleave=bool(text.get("rope_interleave", True)),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            hidden_act=text.get("hidden_act", "silu"),
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=eos_ids,
            weight_prefix=prefix,
            expert_quant=expert_quant,
            fp8_blocks=fp8_blocks,
        )


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} not found: an HF model directory needs config.json beside its "
            f"*.safetensors files; or pass a .gguf file"
        )
    return read_json(path)


# What a model's `config_class` can be; the EAGLE-3 code reads only the fields both share.
ModelConfig = TransformerConfig | DeepseekV3Config

# HF architecture name -> the config class its model reads (models/registry.py maps the same
# names to the models).
_CONFIGS: dict[str, type[ModelConfig]] = {
    "LlamaForCausalLM": TransformerConfig,
    "MistralForCausalLM": TransformerConfig,
    "Qwen2ForCausalLM": TransformerConfig,
    "Qwen3ForCausalLM": TransformerConfig,
    "DeepseekV3ForCausalLM": DeepseekV3Config,
    # Kimi-K2.5 nests a DeepSeek-V3 text model (`text_config`) beside a vision tower, which
    # is not loaded: outrider serves the text model.
    "KimiK25ForConditionalGeneration": DeepseekV3Config,
}


def supported_architectures() -> list[str]:
    return sorted(_CONFIGS)


def resolve_architecture(hf_config: dict[str, Any]) -> str:
    """The first supported name in config.json's `architectures`, or a clear error."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _CONFIGS:
            return name
    raise ValueError(
        f"unsupported architecture {names or hf_config.get('model_type')!r}: outrider supports "
        f"{', '.join(supported_architectures())}"
    )


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """config.json -> the config class of its architecture, filled in."""
    return _CONFIGS[resolve_architecture(hf_config)].from_hf_dict(hf_config)


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """Fail, naming the sizes that work, when `tp_size` cannot split the model `cfg`: attention
    heads, the vocabulary and the MLP split evenly over the ranks; KV heads split too, or each
    is replicated on tp_size / kv_heads ranks (MLA has none: its latent is whole on every
    rank); experts split their width, INT4 ones in whole packed words and scale groups per
    rank."""

    def problems(t: int) -> list[str]:
        out = []
        if cfg.num_attention_heads % t:
            out.append(f"{cfg.num_attention_heads} attention heads")
        kv = getattr(cfg, "num_key_value_heads", None)
        if kv is not None and kv % t and t % kv:
            out.append(f"{kv} KV heads (nor is it a multiple of them)")
        if cfg.vocab_size % t:
            out.append(f"vocabulary of {cfg.vocab_size}")
        if cfg.intermediate_size % t:
            out.append(f"MLP width {cfg.intermediate_size}")
        experts = getattr(cfg, "moe_intermediate_size", None)
        quant = getattr(cfg, "expert_quant", None)
        if experts is not None and experts % t:
            out.append(f"expert width {experts}")
        elif quant is not None and t > 1 and (experts // t) % split_unit(quant.group_size):
            unit = split_unit(quant.group_size)
            out.append(f"INT4 expert width {experts} into multiples of {unit}")
        return out

    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size}: use 1 or more")
    found = problems(tp_size)
    if found:
        fits = [t for t in range(1, cfg.num_attention_heads + 1) if not problems(t)]
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the {' or the '.join(found)}: "
            f"use tensor_parallel_size in {fits}"
        )
