"""FP8 block-quantized checkpoints (DeepSeek-V3's release format): dequantization by block with
partial edge blocks, weights paired with their scales in any order across shards, a tiny
DeepSeek-V3 (and Llama) in that format loading to the same logits and greedy output as the same
weights stored dequantized, and clear refusals."""

import json
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode
from outrider.loaders.checkpoint import open_checkpoint
from outrider.loaders.fp8_blocks import (
    Fp8BlockScheme,
    dequantize_fp8,
    dequantize_fp8_block,
    parse_fp8_config,
    quantize_fp8_block,
)
from outrider.loaders.hf_config import DeepseekV3Config, TransformerConfig
from outrider.plan.models import from_hf_dict
from tests.tiny import hf_reference, outrider_model, prefill_batch, run_forward, tiny_hf_config
from tests.unit.test_deepseek_v3 import VOCAB, _hf_config, _hf_model, _outrider, _save_tokenizer
from tests.unit.test_deepseek_v3_int4 import KIMI_QUANT

# Rows then columns; neither divides every tiny dim, so edge blocks are partial both ways
# (kv_a_proj_with_mqa's 40 rows, 64 and 32 inputs), and rows != cols catches a transpose.
BLOCK = [16, 24]
FP8_QUANT = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": BLOCK,
}  # fmt: skip
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _unquantized(name: str) -> bool:
    """What DeepSeek-V3's release keeps unquantized (1-D tensors aside)."""
    return "norm" in name or name.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight"))


def _reference_dequantize(q, scale_inv, block):
    """The test's own: each element times its block's scale, by expanding the scales."""
    rows, cols = block
    s = scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def _write_fp8_and_plain(src, fp8_dir, plain_dir):
    """`src` (a saved HF checkpoint) -> an FP8-block copy in two shards, and a plain copy whose
    weights are the FP8 values dequantized here. Layer 0's weights go in the second shard and
    their scales in the first (each scale comes before its weight); every other weight in the
    first and its scale in the second (after)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    shards, plain, weight_map = ({}, {}), {}, {}
    for name, w in tensors.items():
        if w.dim() != 2 or not name.endswith(".weight") or _unquantized(name):
            shards[0][name] = plain[name] = w
            continue
        q, scale = quantize_fp8_block(w, BLOCK)
        plain[name] = _reference_dequantize(q, scale, BLOCK)
        late = ".layers.0." in name
        shards[late][name], shards[not late][name + "_scale_inv"] = q, scale
    assert any(n.endswith("_scale_inv") for n in shards[0])
    assert any(n.endswith("_scale_inv") for n in shards[1])
    for shard, file in zip(shards, SHARDS):
        save_file(shard, fp8_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(plain, plain_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (plain_dir / "config.json").write_text(json.dumps(cfg))
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_QUANT}))
    for d in (fp8_dir, plain_dir):
        _save_tokenizer(d)


@pytest.fixture(scope="module")
def fp8_ds(tmp_path_factory):
    """(FP8 checkpoint dir, plain checkpoint dir on the same weights dequantized)."""
    src, fp8_dir, plain_dir = (tmp_path_factory.mktemp(n) for n in ("src", "fp8", "plain"))
    _hf_model(_hf_config(q_lora_rank=48)).save_pretrained(src, safe_serialization=True)
    _write_fp8_and_plain(src, fp8_dir, plain_dir)
    return fp8_dir, plain_dir


def _prefill_logits(model, ids):
    from tests.unit.test_deepseek_v3 import _logits, _seq

    return _logits(model, ForwardMode.PREFILL, [_seq(ids, ids, 0, [0, 1])])


def test_dequantize_by_block_with_partial_edges():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g)
    q, scale = quantize_fp8_block(w, (16, 24))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 3) and scale.dtype == torch.float32
    got = dequantize_fp8_block(q, scale, (16, 24))
    assert torch.equal(got, _reference_dequantize(q, scale, (16, 24)))
    # By hand: element (36, 49) is in the last, partial block of both dims.
    assert got[36, 49] == q[36, 49].float() * scale[2, 2]
    assert (got - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits
    with pytest.raises(
        ValueError, match=r"does not fit a weight \(37, 50\) in blocks of \[16, 16\]"
    ):
        dequantize_fp8_block(q, scale, (16, 16))


def test_weights_pair_with_scales_in_either_order():
    scheme = Fp8BlockScheme((2, 2))
    a, b = (torch.ones(3, 3).to(torch.float8_e4m3fn) for _ in range(2))
    s_a, s_b = torch.full((2, 2), 2.0), torch.full((2, 2), 3.0)
    stream = dequantize_fp8(
        [("a.weight_scale_inv", s_a), ("b.weight", b), ("n.weight", torch.zeros(3)),
         ("a.weight", a), ("b.weight_scale_inv", s_b)],
        scheme,
    )  # fmt: skip
    # The scale of a and the weight b wait; the plain tensor passes at once; each fp8 weight
    # comes out when its pair arrives, under the weight's name.
    assert [(n, t.dtype, t.flatten()[0].item()) for n, t in stream] == [
        ("n.weight", torch.float32, 0.0),
        ("a.weight", torch.float32, 2.0),
        ("b.weight", torch.float32, 3.0),
    ]
    with pytest.raises(ValueError, match=r"a\.weight \(no a\.weight_scale_inv\)"):
        list(dequantize_fp8([("a.weight", a)], scheme))
    with pytest.raises(ValueError, match=r"b\.weight_scale_inv \(no fp8 b\.weight\)"):
        list(dequantize_fp8([("b.weight_scale_inv", s_b), ("b.weight", torch.ones(3, 3))], scheme))
    # No fp8 config: an fp8 tensor is refused, never loaded unscaled.
    with pytest.raises(ValueError, match="a.weight is FP8.*no quantization_config"):
        list(dequantize_fp8([("a.weight", a)], None))
    assert [n for n, _ in dequantize_fp8([("n.weight", torch.zeros(3))], None)] == ["n.weight"]


def test_fp8_checkpoint_loads_as_its_dequantized_weights(fp8_ds):
    fp8_dir, plain_dir = fp8_ds
    assert open_checkpoint(fp8_dir).config.fp8_blocks == Fp8BlockScheme((16, 24))
    fp8, _ = _outrider(fp8_dir)
    plain, _ = _outrider(plain_dir)
    attn = fp8.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert attn.dtype == torch.float32 and attn.shape == (40, 64)
    assert torch.equal(attn, plain.model.layers[0].self_attn.kv_a_proj_with_mqa.weight)
    ids = list(range(5, 25))
    assert (_prefill_logits(fp8, ids) - _prefill_logits(plain, ids)).abs().max() < 1e-4


def test_fp8_greedy_generation_equals_dequantized(fp8_ds):
    fp8_dir, plain_dir = fp8_ds
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 13)]
    params = SamplingParams(temperature=0, max_tokens=10)
    outs = [
        [o.token_ids for o in LLM(str(d), dtype="float32", device="cpu", num_blocks=32)
         .generate(prompts, params)]
        for d in (fp8_dir, plain_dir)
    ]  # fmt: skip
    assert outs[0] == outs[1]


def _copy(src, dst, config=None, drop=()):
    """`src` into `dst`, with another quantization_config and index entries dropped."""
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        cfg["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(cfg))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for name in drop:
        del index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_scale_is_named(fp8_ds, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    _copy(fp8_ds[0], tmp_path, drop=[name + "_scale_inv"])
    with pytest.raises(ValueError, match=f"{name} \\(no {name}_scale_inv\\)"):
        _outrider(tmp_path)


def test_fp8_weights_under_an_int4_config_are_refused(fp8_ds, tmp_path):
    _copy(fp8_ds[0], tmp_path, config=KIMI_QUANT)
    with pytest.raises(
        ValueError, match="is FP8 .* no quantization_config with quant_method 'fp8'"
    ):
        _outrider(tmp_path)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"activation_scheme": "static"}, "fp8 activation_scheme 'static'"),
        ({"fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
        ({"weight_block_size": None}, "fp8 weight_block_size None"),
        ({"weight_block_size": [128]}, r"fp8 weight_block_size \[128\]"),
    ],
)
def test_unsupported_fp8_configs_are_refused_by_name(over, match):
    q = {**FP8_QUANT, **over}
    with pytest.raises(ValueError, match=match) as e:
        parse_fp8_config(q)
    assert "activation_scheme 'dynamic'" in str(e.value)  # what loads
    d = json.loads(json.dumps(_hf_config().to_dict()))
    d.update(architectures=["DeepseekV3ForCausalLM"], quantization_config=q)
    with pytest.raises(ValueError, match=f"DeepseekV3ForCausalLM: .*{match}"):
        DeepseekV3Config.from_hf_dict(d)
    with pytest.raises(ValueError, match=f"LlamaForCausalLM: .*{match}"):
        TransformerConfig.from_hf_dict(tiny_hf_config(quantization_config=q))


def test_static_activations_fail_at_load(fp8_ds, tmp_path):
    _copy(fp8_ds[0], tmp_path, config={**FP8_QUANT, "activation_scheme": "static"})
    with pytest.raises(ValueError, match="activation_scheme 'static'.*'dynamic'"):
        open_checkpoint(tmp_path)


def test_llama_fp8_checkpoint_loads_too(tmp_path):
    src, fp8_dir, plain_dir = (tmp_path / n for n in ("src", "fp8", "plain"))
    for d in (fp8_dir, plain_dir):
        d.mkdir()
    hf_reference(tiny_hf_config(num_hidden_layers=2)).save_pretrained(src)
    _write_fp8_and_plain(src, fp8_dir, plain_dir)
    ids = list(range(5, 25))
    logits = []
    for d in (fp8_dir, plain_dir):
        ckpt = open_checkpoint(d)
        model, _ = outrider_model(ckpt.hf_config, dict(ckpt.iter_tensors()))
        logits.append(model.compute_logits(run_forward(model, prefill_batch([ids]))))
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_planner_reads_fp8_blocks():
    d = json.loads(json.dumps(_hf_config().to_dict()))
    spec = from_hf_dict({**d, "quantization_config": FP8_QUANT})
    assert (spec.weights, spec.expert_weights) == ("fp8", None)
