"""INT4 routed experts from compressed-tensors "pack-quantized" checkpoints (Kimi-K2's format):
the packing layout, dequantization, a tiny DeepSeek-V3 whose experts are packed loading and
matching transformers on the same dequantized weights (fp32), and clear refusals."""

import json
import re
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from outrider.core import ForwardMode
from outrider.loaders.compressed_tensors import (
    Int4Scheme,
    dequantize_int4,
    pack_int4,
    parse_quantization_config,
    quantize_int4,
    unpack_int4,
)
from outrider.loaders.hf_config import DeepseekV3Config
from outrider.models.deepseek_v3 import DeepseekV3ForCausalLM
from outrider.models.weights import SKIP
from tests.unit.test_deepseek_v3 import (
    VOCAB,
    _hf_config,
    _hf_greedy,
    _hf_logits,
    _hf_model,
    _logits,
    _outrider,
    _save_tokenizer,
    _seq,
)

GROUP = 32
# As Kimi-K2-Thinking / Kimi-K2.5 ship it: routed experts only.
KIMI_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": GROUP, "actorder": None, "dynamic": False, "observer": "minmax",
            },
        }
    },
    "ignore": [
        "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}  # fmt: skip
_EXPERT_WEIGHT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def test_packing_layout_and_round_trip():
    # Element 0 in the lowest nibble, each nibble q + 8: -8..-1 -> nibbles 0..7.
    assert pack_int4(torch.arange(-8, 0).view(1, 8)).item() == 0x76543210
    # A 7 in element 7 sets the top nibble to 15: the word reads negative as int32.
    word = pack_int4(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 7]])).item()
    assert word < 0 and word & 0xFFFFFFFF == 0xF8888888
    # 45 values per row: 6 words, the last padded with nibble 0 (which reads back as -8).
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 45), generator=g, dtype=torch.int8)
    q[0, 0, :2] = torch.tensor([-8, 7], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 6)
    assert torch.equal(unpack_int4(packed, 45), q)
    assert (unpack_int4(packed[..., -1:], 8)[..., 5:] == -8).all()
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]]))
    with pytest.raises(ValueError, match="6 packed words per row do not hold 49 values"):
        unpack_int4(packed, 49)


def test_dequantize_equals_a_hand_computation():
    # 2 rows x 10 inputs, groups of 4: three groups (the last holds 2 inputs).
    q = torch.tensor([[-8, -1, 0, 7, 3, -3, 2, 1, 5, -5], [7, 6, 5, 4, 3, 2, 1, 0, -1, -8]])
    scale = torch.tensor([[0.5, 2.0, -1.0], [0.25, 1.5, 3.0]], dtype=torch.bfloat16)
    want = torch.empty(2, 10)
    for r in range(2):
        for c in range(10):
            want[r, c] = q[r, c].item() * scale[r, c // 4].item()
    got = dequantize_int4(pack_int4(q), scale, 10, 4)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    bf16 = dequantize_int4(pack_int4(q), scale, 10, 4, torch.bfloat16)
    assert torch.equal(bf16, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_int4(pack_int4(q), scale[:, :2], 10, 4)
    # quantize_int4 -> dequantize reproduces what was packed, within half a step per group.
    w = torch.randn(6, 70, generator=torch.Generator().manual_seed(1))
    packed, s = quantize_int4(w, GROUP)
    assert packed.shape == (6, 9) and s.shape == (6, 3) and s.dtype == torch.bfloat16
    err = (dequantize_int4(packed, s, 70, GROUP) - w).abs()
    step = s.float().repeat_interleave(GROUP, -1)[:, :70]
    assert (err <= step / 2 + 1e-6).all()


@pytest.fixture(scope="module")
def int4_ds(tmp_path_factory):
    """(INT4 checkpoint dir, transformers model holding the same weights dequantized, the
    unquantized transformers model). moe_intermediate_size 40: down_proj's rows are 5 words
    and two groups, the second partial."""
    return int4_checkpoint(tmp_path_factory, _hf_config(q_lora_rank=48, moe_intermediate_size=40))


def int4_checkpoint(tmp_path_factory, config):
    """The transformers DeepseekV3 `config` with seeded random weights, its routed experts
    quantized as Kimi ships them: (checkpoint dir, transformers model on the dequantized
    weights, the unquantized transformers model)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM as HFModel

    original = _hf_model(config)
    float_dir = tmp_path_factory.mktemp("ds3-dequantized")
    original.save_pretrained(float_dir, safe_serialization=True)
    tensors = load_file(float_dir / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if not _EXPERT_WEIGHT.match(name):
            quantized[name] = dequantized[name] = w
            continue
        packed, scale = quantize_int4(w, GROUP)
        stem = name[: -len("weight")]
        quantized[stem + "weight_packed"] = packed
        quantized[stem + "weight_scale"] = scale
        quantized[stem + "weight_shape"] = torch.tensor(w.shape, dtype=torch.int32)
        dequantized[name] = dequantize_int4(packed, scale, w.shape[1], GROUP)
    assert any(n.endswith("weight_packed") for n in quantized)
    save_file(dequantized, float_dir / "model.safetensors", metadata={"format": "pt"})
    ref = HFModel.from_pretrained(float_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("ds3-int4")
    save_file(quantized, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": KIMI_QUANT}))
    _save_tokenizer(path)
    return path, ref, original


def test_int4_experts_load_packed_and_match_hf(int4_ds):
    path, ref, original = int4_ds
    model, _ = _outrider(path)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_packed.dtype == torch.int32
    assert experts.gate_up_proj_packed.shape == (8, 80, 64 // 8)
    assert experts.down_proj_packed.shape == (8, 64, 5) and experts.down_proj_scale.shape[-1] == 2
    assert not hasattr(experts, "gate_up_proj")  # no dequantized copy kept
    g = torch.Generator().manual_seed(2)
    a = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    blocks = [0, 1, 2]
    want = _hf_logits(ref, a)
    # Quantization changed the model: the comparison below could not pass on the original.
    assert (want - _hf_logits(original, a)).abs().max() > 1e-2
    got = _logits(model, ForwardMode.PREFILL, [_seq(a, a[:17], 0, blocks)])
    assert (got - want[:17]).abs().max() < 1e-3
    got = _logits(model, ForwardMode.PREFILL, [_seq(a, a[17:], 17, blocks)])
    assert (got - want[17:]).abs().max() < 1e-3
    got = _logits(model, ForwardMode.DECODE, [_seq(a, [7], 30, blocks)])
    assert (got[0] - _hf_logits(ref, a + [7])[-1]).abs().max() < 1e-3


def test_int4_greedy_generation_equals_hf(int4_ds):
    path, ref, _ = int4_ds
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (4, 13)]
    want = _hf_greedy(ref, prompts, 10)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=10)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_calibration_prices_the_experts_as_they_run_packed(int4_ds):
    """`outrider plan --calibrate` measures the engine: INT4 experts stay packed there, so the
    measured model reads them as int4 (the rest in the engine's dtype), not as bf16."""
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.plan import calibrate

    m = calibrate.measure_checkpoint(
        open_checkpoint(str(int4_ds[0])), "cpu", "float32", (1,), (0,), 1
    )
    assert (m.model.weights, m.model.expert_weights) == ("fp32", "int4")
    assert [p.batch for p in m.points] == [1] and m.points[0].measured_ms > 0


def test_config_mismatched_with_weights_is_refused(int4_ds, tmp_path):
    path, _, _ = int4_ds
    cfg = DeepseekV3Config.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert cfg.expert_quant == Int4Scheme(group_size=GROUP)
    model = DeepseekV3ForCausalLM(cfg)
    stem = "model.layers.1.mlp.experts.3.up_proj."
    assert model.map_weight_name(stem + "weight_scale") == (
        "model.layers.1.mlp.experts.gate_up_proj_scale",
        (3, "up"),
    )
    assert model.map_weight_name(stem + "weight_shape") is SKIP
    with pytest.raises(ValueError, match="unquantized but config.json"):
        model.map_weight_name(stem + "weight")
    with pytest.raises(ValueError, match="routed experts only"):
        model.map_weight_name("model.layers.0.self_attn.q_a_proj.weight_packed")
    # The packed checkpoint under a config without quantization_config: refused on load.
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    plain = json.loads((path / "config.json").read_text())
    del plain["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(plain))
    with pytest.raises(ValueError, match="quantized but config.json"):
        _outrider(tmp_path)


def _with_weights(**over):
    q = json.loads(json.dumps(KIMI_QUANT))
    q["config_groups"]["group_0"]["weights"].update(over)
    return q


@pytest.mark.parametrize(
    "quant, match",
    [
        ({**KIMI_QUANT, "format": "naive-quantized"}, "format 'naive-quantized'"),
        ({**KIMI_QUANT, "quant_method": "fp8"}, "quant_method 'fp8'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "config_groups"),
        (_with_weights(num_bits=8), "8-bit 'int' weights"),
        (_with_weights(symmetric=False), "asymmetric"),
        (_with_weights(strategy="channel", group_size=None), "strategy 'channel'"),
        (_with_weights(group_size=-1), "group_size -1"),
        (_with_weights(actorder="group"), "actorder 'group'"),
    ],
)
def test_unsupported_quantization_is_refused_by_name(quant, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_quantization_config(quant)
    assert "pack-quantized" in str(e.value) and "bf16" in str(e.value)  # what loads, what to try
    d = json.loads(json.dumps(_hf_config().to_dict()))
    d.update(architectures=["DeepseekV3ForCausalLM"], quantization_config=quant)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM: quantized checkpoint"):
        DeepseekV3Config.from_hf_dict(d)


def test_w4a8_is_refused():
    q = json.loads(json.dumps(KIMI_QUANT))
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match="input_activations"):
        parse_quantization_config(q)
    assert parse_quantization_config(KIMI_QUANT) == Int4Scheme(group_size=32)
