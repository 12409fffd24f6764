"""The network's shape, read from an HF `config.json` dict (GGUF metadata is mapped to the same
dict first, so both checkpoint formats meet here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        from outrider.models.registry import resolve_architecture

        arch = resolve_architecture(d)
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        rope = d.get("rope_parameters") or d.get("rope_scaling")  # transformers 5 / 4 spelling
        rope_theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
        )


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} not found: an HF model directory needs config.json beside its "
            f"*.safetensors files; or pass a .gguf file"
        )
    with open(path) as f:
        return json.load(f)
