"""Checkpoint loading: tiny GGUF files written here with gguf.GGUFWriter (every supported type,
llama.cpp's q/k permutation), tiny sharded HF directories, and the real default model against
transformers' own GGUF loader."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from outrider.loaders.checkpoint import default_model_path, open_checkpoint
from outrider.loaders.gguf import GGUFFile, llama3_rope_scaling
from outrider.loaders.hf_config import (
    DeepseekV3Config,
    TransformerConfig,
    config_from_hf,
    supported_architectures,
)
from outrider.models.registry import model_class
from tests.tiny import tiny_hf_config

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 256, 300  # rows of 256: K-quant blocks
HEAD_DIM = HIDDEN // HEADS

# Independent of outrider's own table, so a wrong mapping there fails here.
_GGUF_NAME = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
# Largest error relative to the tensor's largest magnitude, from each format's step size
# (Q4_0/Q5_0 clip the positive extreme by a full step).
_TOLERANCE = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1,
    Q.Q5_0: 0.08, Q.Q5_1: 0.05, Q.Q2_K: 1e-6, Q.Q3_K: 1e-6, Q.Q4_K: 1e-6, Q.Q5_K: 1e-6,
    Q.Q6_K: 1e-6,
}  # fmt: skip
# One tensor per type; K-quants sit where rows are 256 wide.
_TYPES = {
    "model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.Q6_K,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_0, "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": Q.Q5_0, "model.layers.0.self_attn.o_proj.weight": Q.Q5_1,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_K, "model.layers.0.mlp.up_proj.weight": Q.Q5_K,
    "model.layers.0.mlp.down_proj.weight": Q.Q6_K, "model.layers.1.self_attn.q_proj.weight": Q.F16,
    "model.layers.1.self_attn.k_proj.weight": Q.BF16, "model.layers.1.mlp.gate_proj.weight": Q.Q2_K,
    "model.layers.1.mlp.up_proj.weight": Q.Q3_K,
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAME[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rope halves -> GGML interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# ---- K-quant blocks packed by hand from ggml-quants.c's block layouts -----------------------
# gguf.quants cannot quantize K types, so blocks are built from known integer codes; the
# expected floats follow from the codes by the formats' definitions, independent of gguf.


def _f16(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(0.002, 0.004, size=(n, 1)).astype(np.float16)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """block_q4_K/q5_K scales[12]: eight 6-bit scales and mins (get_scale_min_k4's inverse)."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """qs[128]: byte 32c + l holds element 64c + l (low nibble) and 64c + 32 + l (high)."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def pack_k_quant(qtype: Q, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks [rows, type_size], expected float32 [rows, 256]), one block per row."""
    d = _f16(rng, rows)
    if qtype in (Q.Q4_K, Q.Q5_K):
        dmin = _f16(rng, rows)
        sc, m = rng.integers(0, 64, (rows, 8)), rng.integers(0, 64, (rows, 8))
        q = rng.integers(0, 16 if qtype == Q.Q4_K else 32, (rows, 256))
        sub = np.arange(256) // 32
        expected = d.astype(np.float64) * sc[:, sub] * q - dmin.astype(np.float64) * m[:, sub]
        parts = [d.view(np.uint8), dmin.view(np.uint8), _pack_scale_min(sc, m)]
        if qtype == Q.Q5_K:  # qh[l] bit s = high bit of element 32s + l
            high = ((q >> 4) & 1).reshape(rows, 8, 32) << np.arange(8).reshape(1, 8, 1)
            parts.append(high.sum(axis=1).astype(np.uint8))
        parts.append(_low_nibbles(q))
    else:  # Q6_K: ql[128] qh[64] scales[16] d
        sc = rng.integers(-60, 60, (rows, 16))
        q = rng.integers(0, 64, (rows, 256))
        expected = d.astype(np.float64) * sc[:, np.arange(256) // 16] * (q - 32)
        qq = q.reshape(rows, 2, 4, 32)  # [half, quarter k, l]
        lo = qq & 15
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2)
        qh = ((qq >> 4) << (2 * np.arange(4)).reshape(1, 1, 4, 1)).sum(axis=2)
        parts = [ql.reshape(rows, 128), qh.reshape(rows, 64), sc.astype(np.int8).view(np.uint8)]
        parts = [p.astype(np.uint8) for p in parts] + [d.view(np.uint8)]
    raw = np.concatenate(parts, axis=1)
    assert raw.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    return raw, expected.astype(np.float32)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what GGUFWriter stores, the float values a correct loader must give back)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return pack_k_quant(qtype, w.shape[0], rng)
    if qtype in (Q.Q2_K, Q.Q3_K):
        # No reference but gguf's own dequantizer: random codes, sane fp16 scales at the end.
        raw = rng.integers(0, 256, (w.shape[0], gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        scale_bytes = 4 if qtype == Q.Q2_K else 2
        raw[:, -scale_bytes:] = (
            _f16(rng, w.shape[0] * scale_bytes // 2).view(np.uint8).reshape(w.shape[0], -1)
        )
        return raw, gguf.quants.dequantize(raw, qtype)
    raw = gguf.quants.quantize(w, qtype)
    return raw, w


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    types: dict[str, Q] | None = None,
    tied: bool = True,
    bias: bool = False,
    head_dim: int = HEAD_DIM,
    extra: dict[str, np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A tiny model as llama.cpp would write it. Returns the HF-layout values to expect."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
        if bias:
            for proj, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n * head_dim,)
        if arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if head_dim != HIDDEN // HEADS:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_merges([])
    writer.add_eos_token_id(VOCAB - 1)
    expected = {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        qtype = (types or {}).get(name, Q.F32)
        stored = w
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            stored = llama_cpp_permute(w, HEADS if ".q_proj." in name else KV_HEADS)
        raw, values = encode(stored, qtype, rng)
        # Quantizers approximate `stored`, so the HF original is the reference; K-quant codes
        # are generated in place and define their own values (kept off permuted tensors).
        assert values is stored or stored is w, f"{name}: no HF-order reference for {qtype.name}"
        expected[name] = w if values is stored else values
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name(name), raw)
        else:
            writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _relative_error(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.abs(got.numpy() - want).max() / max(np.abs(want).max(), 1e-12))


# ---- GGUF ----------------------------------------------------------------------------------


def test_gguf_every_type_dequantizes_to_hf_names_shapes_and_values(tmp_path: Path) -> None:
    expected = write_gguf(tmp_path / "m.gguf", types=_TYPES, tied=False)
    tensors = dict(GGUFFile(tmp_path / "m.gguf").iter_tensors())
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        qtype = _TYPES.get(name, Q.F32)
        assert _relative_error(got, want) <= _TOLERANCE[qtype], (name, qtype.name)


def test_gguf_llama_qk_unpermuted_exactly(tmp_path: Path) -> None:
    expected = write_gguf(tmp_path / "m.gguf", bias=True)
    tensors = dict(GGUFFile(tmp_path / "m.gguf").iter_tensors())
    for proj, n_head in (("q", HEADS), ("k", KV_HEADS)):
        for kind in ("weight", "bias"):
            name = f"model.layers.1.self_attn.{proj}_proj.{kind}"
            assert torch.equal(tensors[name], torch.from_numpy(expected[name]))
            # The file really holds another layout, so skipping the un-permute would fail above.
            assert not np.array_equal(llama_cpp_permute(expected[name], n_head), expected[name])


def test_gguf_qwen_not_permuted_biases_and_qk_norm(tmp_path: Path) -> None:
    for arch, bias, head_dim in (("qwen2", True, HEAD_DIM), ("qwen3", False, 32)):
        path = tmp_path / f"{arch}.gguf"
        expected = write_gguf(path, arch=arch, bias=bias, head_dim=head_dim)
        f = GGUFFile(path)
        tensors = dict(f.iter_tensors())
        assert set(tensors) == set(expected)
        for name, want in expected.items():
            assert torch.equal(tensors[name], torch.from_numpy(want)), name
        cfg = f.hf_config()
        assert cfg["architectures"] == [f"Qwen{arch[-1]}ForCausalLM"]
        assert cfg["attention_bias"] is bias and cfg["head_dim"] == head_dim


def test_gguf_metadata_maps_to_hf_config(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tied.gguf")
    write_gguf(tmp_path / "untied.gguf", tied=False)
    cfg = GGUFFile(tmp_path / "tied.gguf").hf_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        HIDDEN,
        LAYERS,
        FFN,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        HEADS,
        KV_HEADS,
        HEAD_DIM,
    )
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (VOCAB, 512)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is True and cfg["rope_scaling"] is None
    assert GGUFFile(tmp_path / "untied.gguf").hf_config()["tie_word_embeddings"] is False


def _hf_llama3_divisors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, **scaling},
    )  # fmt: skip
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).numpy().astype(np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama-3.1 and Llama-3.2
def test_gguf_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path, factor: float) -> None:
    want = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    divisors = _hf_llama3_divisors(500000.0, 128, want)
    assert llama3_rope_scaling(divisors, 500000.0, 128) == {"rope_type": "llama3", **want}
    write_gguf(
        tmp_path / "m.gguf", extra={"rope_freqs.weight": _hf_llama3_divisors(1e4, HEAD_DIM, want)}
    )
    f = GGUFFile(tmp_path / "m.gguf")
    assert "rope_freqs" not in " ".join(name for name, _ in f.iter_tensors())
    assert f.hf_config()["rope_scaling"]["rope_type"] == "llama3"


def _write_bare_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], **uint32: int
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    for key, value in uint32.items():
        writer.add_uint32(key.replace("_", "."), value)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_unsupported_type_names_tensor_type_and_fix(tmp_path: Path) -> None:
    raw = np.zeros((4, HIDDEN // 32 * 18), dtype=np.uint8)  # IQ4_NL: 18 bytes per 32 values
    _write_bare_gguf(tmp_path / "iq.gguf", "llama", {"blk.0.attn_q.weight": (raw, Q.IQ4_NL)})
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight'.*IQ4_NL.*llama-quantize.*Q4_K"):
        GGUFFile(tmp_path / "iq.gguf")


def test_gguf_split_file_asks_for_a_merge(tmp_path: Path) -> None:
    _write_bare_gguf(tmp_path / "m-00001-of-00002.gguf", "llama", {}, split_no=0, split_count=2)
    with pytest.raises(
        ValueError, match=r"part 1 of a 2-file split GGUF.*llama-gguf-split --merge"
    ):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")


def test_gguf_unknown_tensor_is_named(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", extra={"blk.0.attn_rot_embd.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="'blk.0.attn_rot_embd.weight' has no HF counterpart"):
        dict(GGUFFile(tmp_path / "m.gguf").iter_tensors())


def test_gguf_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    _write_bare_gguf(tmp_path / "g.gguf", "gpt2", {})
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        open_checkpoint(tmp_path / "g.gguf")


# ---- HF directories and open_checkpoint -----------------------------------------------------


def write_hf_dir(path: Path, architecture: str = "LlamaForCausalLM") -> dict[str, torch.Tensor]:
    """config.json, two safetensors shards with an index, tokenizer files. Returns the weights."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": False,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 16, generator=gen),
        "model.norm.weight": torch.randn(16, generator=gen).half(),
    }
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(16, 16, generator=gen)
        weights[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(16, 32, generator=gen)
    shards = {"model-00001-of-00002.safetensors": [], "model-00002-of-00002.safetensors": []}
    for i, name in enumerate(weights):
        list(shards.values())[i % 2].append(name)
    for file, names in shards.items():
        save_file({n: weights[n] for n in names}, path / file)
    weight_map = {n: file for file, names in shards.items() for n in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=["<unk>", "<s>", "</s>", "<eot>"])
    tok.train_from_iterator(["hello world"] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{{ messages[0].content }}",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return weights


def test_hf_dir_round_trips_sharded_weights_and_merges_eos(tmp_path: Path) -> None:
    weights = write_hf_dir(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.format == "hf" and ckpt.config.architecture == "LlamaForCausalLM"
    loaded = dict(ckpt.iter_tensors())
    assert set(loaded) == set(weights)
    for name, want in weights.items():
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    assert ckpt.config.eos_token_ids == (2, 3) and ckpt.tokenizer.eos_token_ids == (2, 3)
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_hf_dir_single_file_and_pickle_only(tmp_path: Path) -> None:
    weights = write_hf_dir(tmp_path)
    for shard in tmp_path.glob("model*.safetensors*"):
        shard.unlink()
    save_file(weights, tmp_path / "model.safetensors")
    assert set(dict(open_checkpoint(tmp_path).iter_tensors())) == set(weights)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.*does not load pickles"):
        open_checkpoint(tmp_path)


def test_hf_dir_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    write_hf_dir(tmp_path, architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supports.*LlamaForCausalLM"):
        open_checkpoint(tmp_path)


def test_each_architecture_read_has_a_model_for_its_config() -> None:
    """The loaders read config.json by architecture name and the model registry builds models
    by the same names: every name the loaders accept builds a model whose `config_class` is
    the config they read."""
    from tests.unit.test_deepseek_v3 import _hf_config as deepseek_hf_config

    family = {TransformerConfig: tiny_hf_config(), DeepseekV3Config: deepseek_hf_config().to_dict()}
    for arch in supported_architectures():
        model = model_class(arch)
        cfg = config_from_hf({**family[model.config_class], "architectures": [arch]})
        assert type(cfg) is model.config_class, arch


def test_open_checkpoint_bad_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf.*\.gguf file, an HF model directory"):
        open_checkpoint(missing)
    with pytest.raises(ValueError, match="without config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin' is not a \.gguf file"):
        open_checkpoint(tmp_path / "weights.bin")
    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"one of its GGUF files: m\.gguf"):
        open_checkpoint(tmp_path)


# ---- the embedded default model against transformers' GGUF loader ----------------------------


@pytest.fixture(scope="module")
def default_ckpt():
    start = time.perf_counter()
    ckpt = open_checkpoint(None)
    tensors = dict(ckpt.iter_tensors())
    print(f"\ndefault model: open + dequantize {time.perf_counter() - start:.2f} s")
    return ckpt, tensors


@pytest.mark.slow
def test_default_model_config(default_ckpt) -> None:
    ckpt, tensors = default_ckpt
    cfg = ckpt.config
    assert ckpt.format == "gguf" and ckpt.path == default_model_path()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors and len(tensors) == 272
    assert "<|im_start|>" in ckpt.tokenizer.chat_template
    assert ckpt.tokenizer.eos_token_ids == (2,) == cfg.eos_token_ids


@pytest.mark.slow
def test_default_model_weights_match_transformers(default_ckpt) -> None:
    from transformers import AutoModelForCausalLM

    tensors = default_ckpt[1]
    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    want = ref.state_dict()
    # q_proj/k_proj equal only if llama.cpp's rope permutation was undone as transformers does.
    names = [
        "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
    ]  # fmt: skip
    for name in names:
        assert tensors[name].shape == want[name].shape, name
        assert torch.allclose(tensors[name], want[name], rtol=0, atol=1e-6), name
    assert set(tensors) == set(want) - {"lm_head.weight"}
    assert not math.isnan(sum(float(t.abs().max()) for t in tensors.values()))
