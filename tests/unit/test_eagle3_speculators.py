"""EAGLE-3 drafters in the `speculators` layout (github.com/vllm-project/speculators; vLLM loads
it natively): what the file says and holds, exact round trips through all three layouts, a file
written the way speculators 0.9 writes one, every malformed field refused by name, the doctor,
`drafter export --format speculators`, and greedy serving through the engine equal to plain."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from outrider import LLM, SamplingParams
from outrider.models.eagle3_io import load_drafter, read_config, resolve_layout, save_drafter
from outrider.speculative.eagle3_doctor import diagnose
from tests.unit.test_eagle3_doctor import tiny_target
from tests.unit.test_eagle3_io import assert_same, edit, random_drafter, target_config
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)

FINGERPRINT = {"model": "org/tiny-llama", "architecture": "LlamaForCausalLM", "vocab_size": 512}


@pytest.fixture(scope="module")
def target():
    return target_config()  # 8 layers: aux layers (2, 4, 5)


@pytest.fixture(scope="module")
def draft(target):
    return random_drafter(target)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_the_file_says_what_speculators_and_vllm_read(tmp_path, draft):
    path = save_drafter(draft, tmp_path / "d", "speculators", extra={"target": FINGERPRINT})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["vocab_size"], layer["head_dim"]) == (128, 512, 16)
    assert layer["tie_word_embeddings"] is False and layer["mlp_bias"] is False
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (64, 128)
    # Written although false is speculators' default: vLLM reads a missing one as true.
    assert cfg["norm_before_residual"] is False
    assert not any(cfg[k] for k in ("norm_before_fc", "fc_norm", "norm_output"))
    # vLLM passes the ids through and captures the input of layer id: our convention.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "eagle_config" not in cfg and "hidden_size" not in cfg
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {
        "name_or_path": "org/tiny-llama",
        "architectures": ["LlamaForCausalLM"],
    }
    assert cfg["outrider"]["layout"] == "speculators" and cfg["outrider"]["aux_layers"] == [2, 4, 5]
    # Tensor names are vLLM's (layers.0.*); the target's embedding is not stored.
    vllm = save_drafter(draft, tmp_path / "v", "vllm")
    assert tensors_of(path).keys() == tensors_of(vllm).keys()
    assert "layers.0.self_attn.q_proj.weight" in tensors_of(path)
    assert not any("embed_tokens" in n for n in tensors_of(path))
    # Flattened as vLLM flattens it, it is the vLLM-layout config on every field a loader reads.
    flat, flat_vllm = read_config(path), read_config(vllm)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size", "rms_norm_eps",
                "rope_theta", "max_position_embeddings", "eagle_aux_hidden_state_layer_ids"):  # fmt: skip
        assert flat[key] == flat_vllm[key], key
    assert resolve_layout(flat) == "vllm"  # the convention its ids are read in
    # Without the trainer's fingerprint the target is unknown: null, as speculators allows.
    bare = json.loads(
        (save_drafter(draft, tmp_path / "b", "speculators") / "config.json").read_text()
    )
    assert bare["speculators_config"]["verifier"] == {"name_or_path": None, "architectures": []}


CYCLES = [
    ("sglang", "speculators", "vllm", "sglang"),
    ("vllm", "speculators", "sglang", "vllm"),
    ("speculators", "sglang", "vllm", "speculators"),
    ("speculators", "vllm", "speculators"),
]


# Llama 3.1's rope, as a drafter for such a target carries it.
LLAMA3 = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256}}  # fmt: skip


@pytest.mark.parametrize("cycle", CYCLES, ids="->".join)
@pytest.mark.parametrize("dtype,rope", [(torch.float32, {}), (torch.bfloat16, LLAMA3)])
def test_round_trips_through_every_layout_are_exact(tmp_path, cycle, dtype, rope):
    target = target_config(**rope)
    src = random_drafter(target, seed=2).to(dtype)
    assert src.config.rope_theta == rope.get("rope_theta", 10000.0)
    first = path = save_drafter(src, tmp_path / "0", cycle[0])
    for i, layout in enumerate(cycle[1:], 1):
        loaded = load_drafter(path, target)
        assert_same(src, loaded)  # parameters, d2t, t2d, dtype and the whole Eagle3Config
        path = save_drafter(loaded, tmp_path / str(i), layout)
    assert_same(src, load_drafter(path, target))
    # Back in the first layout, the files are the same files.
    assert (path / "config.json").read_text() == (first / "config.json").read_text()
    a, b = tensors_of(first), tensors_of(path)
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a
    )


def speculators_written(path: Path, draft, target) -> Path:
    """The directory speculators 0.9's Eagle3DraftModel.save_pretrained writes for `draft` (its
    keys as seen in one: transformers 5 `dtype` and `rope_parameters`, the library's own
    bookkeeping, null target_hidden_size and ids, the full-vocabulary embedding, no outrider
    record), from the tensors outrider saves."""
    src = save_drafter(draft, path.parent / (path.name + "-src"), "vllm")
    tensors = tensors_of(src)
    tensors["embed_tokens.weight"] = torch.randn(target.vocab_size, target.hidden_size)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(src)
    c = draft.config
    layer = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "float32",
        "eos_token_id": 2, "head_dim": c.head_dim, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size, "max_position_embeddings": 512,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": 1, "num_key_value_heads": c.num_key_value_heads,
        "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False, "transformers_version": "5.24.0", "use_cache": True,
        "vocab_size": c.vocab_size,
    }  # fmt: skip
    greedy = {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
              "verifier_accept_k": 1}  # fmt: skip
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": c.draft_vocab_size, "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": None, "embed_requires_grad": False, "fc_norm": False,
        "norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [greedy],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/tiny"},
        },
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "target_hidden_size": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformer_layer_config": layer, "transformers_version": "5.24.0",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_loads_a_file_written_the_way_speculators_writes_it(tmp_path, target, draft):
    path = speculators_written(tmp_path / "spec", draft, target)
    assert_same(draft, load_drafter(path, target))  # defaults: aux (2, 4, 5), hidden 128
    # A caller's other guess does not change how a speculators file's ids are read.
    edit(path, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert load_drafter(path, target, layout="sglang").config.aux_layers == (2, 4, 5)
    # Older exports: the Eagle3Speculator name, training-only verifier tensors left in.
    edit(
        path,
        lambda c: c.update(architectures=["Eagle3Speculator"]),
        lambda ts: ts.update(
            {
                "verifier_lm_head.weight": torch.zeros(64, 128),
                "verifier_norm.weight": torch.ones(128),
            }
        ),  # fmt: skip
    )
    assert_same(draft, load_drafter(path, target))
    # A full draft vocabulary: speculators stores no d2t/t2d; the mapping is the identity.
    full = random_drafter(target, draft_vocab=512)
    full.d2t.zero_()
    full.t2d.fill_(True)
    path = speculators_written(tmp_path / "full", full, target)
    edit(path, tensors=lambda ts: (ts.pop("d2t"), ts.pop("t2d")))
    assert_same(full, load_drafter(path, target))


def _set(field: str, value):
    """A config edit: set (or, with value ..., delete) the dotted field."""

    def change(cfg):
        *parents, key = field.split(".")
        for p in parents:
            cfg = cfg[p]
        if value is ...:
            del cfg[key]
        else:
            cfg[key] = value

    return change


# (field, value: ... deletes it, what the error must say) for the format's own checks: each
# error names the file, the field and what to do.
MALFORMED = [
    ("speculators_model_type", "dflash", r"speculators_model_type is 'dflash': .* EAGLE-3"),
    ("transformer_layer_config", ..., r"transformer_layer_config is missing: .* Llama config"),
    ("transformer_layer_config.model_type", "qwen3", r"model_type is 'qwen3': .* llama-layer"),
    ("transformer_layer_config.hidden_size", ..., r"config\.hidden_size is missing: a positive"),
    ("transformer_layer_config.num_hidden_layers", 2, r"num_hidden_layers is 2: .* one-layer"),
    ("transformer_layer_config.attention_bias", True, r"attention_bias is True: .* plain Llama"),
    ("transformer_layer_config.layer_types", ["sliding_attention"], r"layer_types is \['sliding"),
    ("draft_vocab_size", ..., r"draft_vocab_size is missing: set it to lm_head's row count"),
    ("norm_before_residual", ..., r"norm_before_residual is missing: set true or false"),
    ("norm_before_fc", True, r"norm_before_fc is True: an RMSNorm .* trained without it"),
    ("norm_output", True, r"norm_output is True: .* fed back"),
    ("target_hidden_size", "128", r"target_hidden_size is '128': use the target's hidden size"),
    ("speculators_config", ..., r"speculators_config is missing: it must be an object"),
    ("speculators_config.algorithm", "eagle", r"speculators_config\.algorithm is 'eagle'"),
    ("speculators_config.proposal_methods", [], r"proposal_methods is \[\]: list at least one"),
    ("speculators_config.default_proposal_method", "tree",
     r"default_proposal_method is 'tree': name one of .* \['greedy'\]"),
    ("speculators_config.proposal_methods", [{"proposal_type": "greedy"}],
     r"proposal_methods\[0\]\.speculative_tokens is missing: vLLM"),
    ("speculators_config.verifier", ..., r"speculators_config\.verifier is missing: use \{"),
    ("speculators_config.verifier.architectures", ..., r"architectures is missing: list the"),
    ("speculators_config.verifier.name_or_path", 3, r"name_or_path is 3: use the target's"),
]  # fmt: skip
# Well-formed files that do not fit this target: the loaders' checks, with the values.
MISFIT = [
    ("eagle_aux_hidden_state_layer_ids", [2, 4, 9],
     r"aux layers \[2, 4, 9\] \(read as vllm ids \[2, 4, 9\]\) .* in 0\.\.7 .* deeper model$"),
    ("transformer_layer_config.vocab_size", 600, r"vocab_size=600 but the target's vocabulary"),
    ("target_hidden_size", 256, r"target_hidden_size=256 but the target's hidden_size is 128"),
]  # fmt: skip


def malformed(tmp_path, draft, field, value) -> Path:
    path = save_drafter(draft, tmp_path / "d", "speculators")
    edit(path, lambda c: (c.pop("outrider"), _set(field, value)(c)))
    return path


@pytest.mark.parametrize("field,value,match", MALFORMED)
def test_a_malformed_config_is_refused_naming_the_field(
    tmp_path, target, draft, field, value, match
):
    path = malformed(tmp_path, draft, field, value)
    with pytest.raises(ValueError, match=match) as e:
        load_drafter(path, target)
    assert str(e.value).startswith(f"{str(path / 'config.json')!r} (speculators layout): {field}")


@pytest.mark.parametrize("field,value,match", MISFIT)
def test_a_drafter_for_another_target_is_refused(tmp_path, target, draft, field, value, match):
    with pytest.raises(ValueError, match=match):
        load_drafter(malformed(tmp_path, draft, field, value), target)


def test_the_doctor_reads_speculators_files(tmp_path):
    checkpoint = tiny_target()
    draft = random_drafter(checkpoint.config)
    path = save_drafter(draft, tmp_path / "d", "speculators")
    report = diagnose(path, checkpoint)
    assert report.ok, str(report)
    assert "vLLM ids [2, 4, 5] = inputs of layers [2, 4, 5]" in report["aux_layers"].message
    edit(path, _set("norm_output", True))
    report = diagnose(path, checkpoint)
    assert not report.ok and report["config"].ok is False
    assert "norm_output is True" in report["config"].message


GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def served_target(tiny_dir, tmp_path_factory):  # noqa: F811
    """tiny_dir's tokenizer with a narrower 8-layer target: EAGLE-3's default aux layers
    (2, L//2, L-3) collide below 6 layers, and a drafter file's ids must name distinct ones."""
    from tests.tiny import hf_reference, tiny_hf_config

    path = tmp_path_factory.mktemp("tiny-8-layers")
    cfg = tiny_hf_config(num_hidden_layers=8, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    hf_reference(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir[0] / name, path / name)
    return path


def test_a_speculators_drafter_serves_greedy_equal_to_plain(served_target, prompts, tmp_path):  # noqa: F811
    """Through the front door: the engine reads the file's layout, the doctor passes it, the
    drafter served is the one written, bit for bit, and the output is the target's own."""
    from outrider.loaders.checkpoint import open_checkpoint
    from tests.unit.test_spec_eagle3 import random_drafter as serving_drafter

    few = prompts[:4]  # the suite runs on two cores
    plain = LLM(str(served_target), dtype="float32", device="cpu", num_blocks=256)
    want = [o.token_ids for o in plain.generate(few, GREEDY)]
    draft = serving_drafter(open_checkpoint(str(served_target)).config)
    path = save_drafter(draft, tmp_path / "spec", "speculators")
    spec = {"method": "eagle3", "controller": "fixed", "draft": str(path), "num_draft_tokens": 4}
    llm = LLM(str(served_target), dtype="float32", device="cpu", num_blocks=256, speculative=spec)
    served = llm.engine.speculator.proposer.draft
    assert served.config == draft.config and served.config.aux_layers == (2, 4, 5)
    assert all(torch.equal(t, served.state_dict()[k]) for k, t in draft.state_dict().items())
    assert [o.token_ids for o in llm.generate(few, GREEDY)] == want
    stats = llm.engine.speculator.stats
    assert stats.num_verify_steps > 0 and stats.num_draft_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_cli_exports_the_speculators_layout(served_target, tmp_path):
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.train.cli import add_drafter_parser, cmd_drafter
    from tests.unit.test_spec_eagle3 import random_drafter as serving_drafter

    target = open_checkpoint(str(served_target)).config
    draft = serving_drafter(target)
    src = save_drafter(draft, tmp_path / "sg")
    parser = argparse.ArgumentParser()
    add_drafter_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "spec"
    args = parser.parse_args(
        [
            "drafter",
            "export",
            str(src),
            str(out),
            "--format",
            "speculators",
            "--model",
            str(served_target),
        ]
    )
    assert cmd_drafter(args) == 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert_same(draft, load_drafter(out, target))


def _norm_before_residual(target, seed=4):
    import dataclasses

    from outrider.models.eagle3 import Eagle3Draft

    plain = random_drafter(target, seed=seed)
    variant = Eagle3Draft(dataclasses.replace(plain.config, norm_before_residual=True))
    variant.load_state_dict(plain.state_dict())
    return plain, variant


def test_norm_before_residual_adds_the_normed_hidden(target):
    """vLLM's and speculators' variant: the layer's residual is hidden_norm(hidden), not the
    hidden as it came; everything else is the same layer (a reference written out here)."""
    from outrider.layers.rotary import Rope, RotaryEmbedding

    plain, variant = _norm_before_residual(target)
    layer = variant.midlayer
    torch.manual_seed(0)
    n, h = 5, variant.config.hidden_size
    embeds, hidden = torch.randn(n, h), torch.randn(n, h)
    pos = torch.arange(n)
    rope = Rope(
        pos, variant.rotary_emb.cos[pos][:, None], variant.rotary_emb.sin[pos][:, None], False
    )

    def causal(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    with torch.no_grad():
        _, residual = layer(rope, embeds, hidden, causal)
        _, plain_residual = plain.midlayer(rope, embeds, hidden, causal)
        normed = layer.hidden_norm(hidden)
        attn_in = torch.cat([layer.input_layernorm(embeds), normed], -1)
        sizes = [layer.q_size, layer.kv_size, layer.kv_size]
        q, k, v = layer.self_attn.qkv_proj(attn_in).split(sizes, -1)
        d = layer.head_dim
        q, k = RotaryEmbedding.apply(rope, q.view(n, -1, d), k.view(n, -1, d))
        attn = causal(q, k, v.view(n, -1, d))
        want_residual = normed + layer.self_attn.o_proj(attn)
    torch.testing.assert_close(residual, want_residual, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(residual, plain_residual)  # the variant changes the output


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_norm_before_residual_round_trips_and_sglang_refuses_it(tmp_path, target, layout):
    _, variant = _norm_before_residual(target)
    path = save_drafter(variant, tmp_path / layout, layout)
    assert json.loads((path / "config.json").read_text())["norm_before_residual"] is True
    loaded = load_drafter(path, target)
    assert loaded.config.norm_before_residual is True
    assert_same(variant, loaded)
    with pytest.raises(ValueError, match="SGLang's EAGLE-3 layer does not compute"):
        save_drafter(variant, tmp_path / "sglang", "sglang")
