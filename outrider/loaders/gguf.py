"""A GGUF checkpoint (llama.cpp's single-file format): its metadata mapped to an HF config dict,
its tensors renamed to HF parameter names, dequantized to float32 and put back in HF layout.

Reading goes through the `gguf` package (the reader and dequantizers llama.cpp ships).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from outrider.loaders.gguf_layout import check_layout

Q = gguf.GGMLQuantizationType

# general.architecture -> HF architecture name. Mistral GGUFs say "llama" (llama.cpp converts
# Mistral with its Llama converter); llama.cpp has no plain "mistral" architecture.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# convert_hf_to_gguf.py's LlamaModel.permute rewrites q/k rows of these to GGML's interleaved
# rope layout; qwen2/qwen3 use neox rope and are stored as in HF.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

# Types gguf.quants dequantizes in vectorized numpy. The i-quants are left out on purpose: their
# numpy dequantizers are slow grid lookups, and no test covers them here.
SUPPORTED_TYPES: tuple[Q, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors that carry config rather than parameters: rope_freqs holds Llama-3's rope scaling,
# which hf_config() turns back into `rope_scaling`.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})


class _Reader(gguf.GGUFReader):
    """GGUFReader on a plain ndarray view of its memmap. The reader slices its buffer once per
    token string (~250k times for a 49k vocabulary), and every slice of an np.memmap pays for
    memmap.__array_finalize__: the view cuts opening the default model from ~4.5 s to ~1.5 s.
    The view still shares the mapping, so tensor data stays lazy."""

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = value.view(np.ndarray)


class GGUFFile:
    """One opened .gguf file. Metadata is read at once; tensor data is read by iter_tensors()."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_layout(self.path)
        try:
            self._reader = _Reader(self.path)
        except (ValueError, OSError, IndexError, KeyError) as e:  # what a broken file raises
            raise ValueError(
                f"{str(self.path)!r} could not be read as GGUF ({e}): check the file is a complete "
                f"GGUF v2/v3 download"
            ) from e
        self.metadata: dict[str, Any] = {
            name: field.contents()
            for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")
        }
        if self.metadata.get("split.count", 1) > 1:
            raise ValueError(
                f"{str(self.path)!r} is part {self.metadata.get('split.no', 0) + 1} of a "
                f"{self.metadata['split.count']}-file split GGUF: merge the parts into one file "
                f"with llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf` and pass that"
            )
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            found = "lacks" if architecture is None else f"has {architecture!r:.80} as"
            raise ValueError(
                f"{str(self.path)!r} {found} metadata general.architecture, the model's "
                "architecture name: the file is incomplete; re-convert it with llama.cpp's "
                "convert_hf_to_gguf.py"
            )
        self.architecture: str = architecture
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{str(self.path)!r} has general.architecture={self.architecture!r}: outrider "
                f"reads GGUF architectures {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; for "
                f"another model pass its HF directory (config.json + *.safetensors)"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"tensor {t.name!r} in {str(self.path)!r} is {t.tensor_type.name}, which "
                    f"outrider cannot dequantize: re-quantize with llama.cpp's llama-quantize to "
                    f"one of {', '.join(q.name for q in SUPPORTED_TYPES)}"
                )

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tokenizer_fields(self) -> dict[str, Any]:
        """The `tokenizer.*` metadata, keys as in the file (Tokenizer.from_gguf_fields' input)."""
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a config.json-shaped dict (TransformerConfig.from_hf_dict's input)."""
        heads = self._require("attention.head_count")
        hidden = self._require("embedding_length")
        head_dim = self._positive("attention.key_length") or hidden // heads
        theta = _f32(self._positive("rope.freq_base", float) or 10000.0)
        return {
            "architectures": [SUPPORTED_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self._vocab_rows(),
            "hidden_size": hidden,
            "intermediate_size": self._require("feed_forward_length"),
            "num_hidden_layers": self._require("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._positive("attention.head_count_kv") or heads,
            "head_dim": head_dim,
            "rms_norm_eps": _f32(self._positive("attention.layer_norm_rms_epsilon", float) or 1e-5),
            "rope_theta": theta,
            "rope_scaling": self._rope_scaling(theta, head_dim),
            "max_position_embeddings": self._positive("context_length") or 2048,
            # llama.cpp writes no output.weight when lm_head shares the embedding.
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "hidden_act": "silu",
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            # The tokenizer adds end-of-turn ids (eot/eom) to this; see open_checkpoint.
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }

    def _require(self, key: str) -> int:
        value = self._positive(key)
        if value is None:
            raise ValueError(
                f"{str(self.path)!r} lacks metadata {self.architecture}.{key}: the file is "
                f"incomplete; re-convert it with llama.cpp's convert_hf_to_gguf.py"
            )
        return value

    def _positive(self, key: str, kind: type = int) -> Any:
        """The metadata value of `key`, a positive integer (or number, for kind float), or None
        when the file has none."""
        value = self._get(key)
        kinds = (int, float) if kind is float else (int,)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            raise ValueError(
                f"{str(self.path)!r} has metadata {self.architecture}.{key} = {value!r:.80}, "
                f"expected a positive {'number' if kind is float else 'integer'}: the file is "
                "corrupt; re-convert it with llama.cpp's convert_hf_to_gguf.py"
            )
        return value

    def _vocab_rows(self) -> int:
        """The embedding's rows, which the output matrix's rows, the vocab_size metadata and the
        tokenizer's token count must fit: a model built to one of them and loaded with another
        has its tensors cut, or refuses prompts whose ids it cannot embed."""
        embd = self._tensors.get("token_embd.weight")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        tokens = len(tokens) if isinstance(tokens, list) else 0  # the tokenizer checks its kind
        declared = self._positive("vocab_size")
        if embd is None:
            return declared or tokens
        where = f"{str(self.path)!r}: tensor 'token_embd.weight' has shape {embd.shape.tolist()}"
        if len(embd.shape) != 2:
            raise ValueError(f"{where}, expected [hidden, vocab]: the file is corrupt")
        rows = int(embd.shape[1])  # GGUF lists dims fastest first: [hidden, vocab]
        out = self._tensors.get("output.weight")
        if out is not None and out.shape.tolist()[1:] != [rows]:
            raise ValueError(
                f"{where}, but 'output.weight' has {out.shape.tolist()}: their vocab rows "
                "differ; the file mixes two models' weights, re-convert it"
            )
        if declared is not None and declared != rows:
            raise ValueError(
                f"{where}, but its metadata {self.architecture}.vocab_size is {declared}: the "
                "config and the weights disagree; re-convert the model"
            )
        if tokens > rows:
            raise ValueError(
                f"{where}, but tokenizer.ggml.tokens lists {tokens} tokens: ids past {rows - 1} "
                "would have no embedding; the tokenizer is of another model, re-convert it"
            )
        return rows

    def _rope_scaling(self, theta: float, head_dim: int) -> dict[str, Any] | None:
        kind = self._get("rope.scaling.type")
        factor = self._get("rope.scaling.factor") or self._get("rope.scale_linear")
        if kind == "linear" or (kind is None and factor and factor != 1.0):
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            scaling = {
                "rope_type": "yarn",
                "factor": float(factor),
                "original_max_position_embeddings": self._get(
                    "rope.scaling.original_context_length"
                ),
            }
            for key in ("beta_fast", "beta_slow"):
                if (value := self._get(f"rope.scaling.yarn_{key}")) is not None:
                    scaling[key] = float(value)
            return scaling
        if kind not in (None, "none"):
            raise ValueError(
                f"{str(self.path)!r} uses rope scaling {kind!r}: outrider reads 'linear', 'yarn' "
                f"and Llama-3's rope_freqs; use the model's HF checkpoint instead"
            )
        if "rope_freqs.weight" in self._tensors:
            factors = _dequantize(self._tensors["rope_freqs.weight"]).numpy()
            return llama3_rope_scaling(factors, theta, head_dim)
        return None

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 CPU tensor in HF shape and layout), one tensor at a time."""
        permuted = self.architecture in _PERMUTED_ARCHITECTURES
        heads = self._require("attention.head_count")
        kv_heads = self._positive("attention.head_count_kv") or heads
        for t in self._reader.tensors:
            if t.name in _CONFIG_TENSORS:
                continue
            name = hf_tensor_name(t.name)
            w = _dequantize(t)
            if permuted and ".q_proj." in name:
                w = unpermute_rope(w, heads)
            elif permuted and ".k_proj." in name:
                w = unpermute_rope(w, kv_heads)
            yield name, w


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (biases likewise)."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[parts[0]]}.{kind}"
        if (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in _LAYER_NAMES
        ):
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no HF counterpart outrider knows (it maps "
        f"{', '.join(_GLOBAL_NAMES)} and blk.N.{{{', '.join(_LAYER_NAMES)}}}): the file is from "
        f"an architecture variant outrider does not support; try the model's HF checkpoint"
    )


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on q/k rows (weight or bias).

    GGML's rope rotates adjacent pairs (2j, 2j+1) of each head; HF's rotates (j, j + d/2). The
    converter moved HF row t*d/2 + j to GGML row 2j + t; this moves it back:
        GGML head rows [x0 y0 x1 y1 ...] -> HF head rows [x0 x1 ... y0 y1 ...]
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(
            f"cannot un-permute a tensor of shape {tuple(w.shape)} over {n_head} heads: rows must "
            f"be a multiple of 2 * heads; the file's attention.head_count metadata is wrong"
        )
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover HF's "llama3" rope_scaling from llama.cpp's rope_freqs tensor.

    The converter stores only the per-frequency divisors r_i, computed from HF's
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    r = 1 where the wavelength is short, r = factor where it is long, and between them
    1/r = (1 - s)/factor + s with s = (L/wavelen - low)/(high - low), linear in 1/wavelen.
    A line fitted through the smooth region gives L/(high - low) and low/(high - low); (L, low,
    high) are fixed only up to a common scale, so low_freq_factor is taken as 1 (every
    Llama-3.x release uses 1), which gives back the released values exactly.
    """
    r = factors.astype(np.float64).reshape(-1)
    if np.allclose(r, 1.0):
        return None
    factor = float(r.max())
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / (2 * math.pi)
    smooth = (1 / r - 1 / factor) / (1 - 1 / factor)
    mid = (r > 1 + 1e-3) & (r < factor * (1 - 1e-3))
    if len(r) != len(inv_wavelen) or mid.sum() < 2:
        raise ValueError(
            f"rope_freqs ({len(r)} factors, {int(mid.sum())} in the smooth band) does not match "
            f"Llama-3 rope scaling for head_dim={head_dim}: use the model's HF checkpoint"
        )
    slope, intercept = np.polyfit(inv_wavelen[mid], smooth[mid], 1)
    span = -1.0 / intercept  # (high - low) / low with low = 1
    return {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(1.0 + span, 3),
        "original_max_position_embeddings": int(round(slope * span)),
    }


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _dequantize(t: Any) -> torch.Tensor:
    """A ReaderTensor as a float32 torch tensor in HF shape (GGUF lists dims fastest-first)."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    if t.tensor_type == Q.F32:
        values = values.copy()  # a view of the read-only mapping otherwise
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape)
