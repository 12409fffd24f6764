"""EAGLE-3 drafter files: bit-exact save -> load in every layout, the names and aux-id
conventions each engine reads, foreign spellings accepted on load, and every way a file can
fail to fit its target refused with the values named. The speculators layout's own tests:
test_eagle3_speculators.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from outrider.loaders.hf_config import TransformerConfig
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
from outrider.models.eagle3_io import (
    engine_aux_ids,
    load_drafter,
    outrider_aux_layers,
    resolve_layout,
    save_drafter,
)
from outrider.speculative.eagle3_vocab import build_draft_vocab
from tests.tiny import tiny_hf_config

LAYERS = 8  # aux layers (2, 4, 5); fewer than 6 layers make EAGLE-3's defaults collide


def target_config(**over) -> TransformerConfig:
    return TransformerConfig.from_hf_dict(tiny_hf_config(num_hidden_layers=LAYERS, **over))


def random_drafter(target: TransformerConfig, draft_vocab: int = 64, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config.for_target(target, draft_vocab))
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p))
    counts = torch.randint(0, 100, (target.vocab_size,))
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


def edit(path: Path, config=None, tensors=None) -> None:
    """Rewrite a saved drafter the way another exporter (or a careless hand) would."""
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        with safe_open(path / "model.safetensors", "pt") as f:
            ts = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        tensors(ts)
        save_file(ts, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def target() -> TransformerConfig:
    return target_config()


@pytest.fixture(scope="module")
def draft(target) -> Eagle3Draft:
    return random_drafter(target)


def assert_same(a: Eagle3Draft, b: Eagle3Draft) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    assert a.config == b.config


@pytest.mark.parametrize("layout", ["sglang", "vllm", "speculators"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, target, draft, layout, dtype):
    src = random_drafter(target).to(dtype)
    path = save_drafter(src, tmp_path / "d", layout)
    loaded = load_drafter(path, target)
    assert_same(src, loaded)
    assert loaded.config.aux_layers == (2, 4, 5)
    assert loaded.fc.weight.dtype == dtype and loaded.rotary_emb.cos.dtype == torch.float32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp dirs left behind


def test_each_layout_writes_what_its_engine_reads(tmp_path, draft):
    sg = json.loads((save_drafter(draft, tmp_path / "sg", "sglang") / "config.json").read_text())
    vl = json.loads((save_drafter(draft, tmp_path / "vl", "vllm") / "config.json").read_text())
    for cfg in (sg, vl):
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
        assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
        assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (
            512,
            64,
            128,
        )
        assert cfg["eagle_config"]["use_aux_hidden_state"] is True
        assert cfg["outrider"]["aux_layers"] == [2, 4, 5]
    # SGLang adds 1 to explicit ids (captures before layer id + 1): ours minus one, nested only.
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in sg
    # vLLM uses ids as given (captures before layer id), and reads the top-level key.
    assert vl["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert vl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with safe_open(tmp_path / "sg" / "model.safetensors", "pt") as f:
        sg_names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    with safe_open(tmp_path / "vl" / "model.safetensors", "pt") as f:
        vl_names = set(f.keys())
    assert (
        "midlayer.self_attn.q_proj.weight" in sg_names and "midlayer.hidden_norm.weight" in sg_names
    )
    assert {n.replace("midlayer.", "layers.0.") for n in sg_names} == vl_names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in sg_names)


def test_unpacked_tensors_are_the_hf_projections(tmp_path, draft):
    """q/k/v and gate/up on disk are the HF modules' weights: x @ q_proj.T is the q part of the
    packed projection (so a transformers- or SGLang-built layer computes what ours does)."""
    path = save_drafter(draft, tmp_path / "d")
    with safe_open(path / "model.safetensors", "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    cfg = draft.config
    x = torch.randn(3, 2 * cfg.hidden_size)
    q, k, v = draft.midlayer.self_attn.qkv_proj(x).split([128, 32, 32], dim=-1)
    for name, part in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(x @ w[f"midlayer.self_attn.{name}_proj.weight"].T, part)
    h = torch.randn(3, cfg.hidden_size)
    gate, up = draft.midlayer.mlp.gate_up_proj(h).split(cfg.intermediate_size, dim=-1)
    torch.testing.assert_close(h @ w["midlayer.mlp.gate_proj.weight"].T, gate)
    torch.testing.assert_close(h @ w["midlayer.mlp.up_proj.weight"].T, up)


def sglang_reference(w: dict, cfg: Eagle3Config, layer: str, embeds, aux, positions):
    """SGLang's LlamaForCausalLMEagle3 forward written out from the saved HF tensors."""

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def proj(x, name):
        return x @ w[f"{layer}.{name}.weight"].T

    t, nh, nkv, hd = aux.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hidden = aux @ w["fc.weight"].T
    x = torch.cat([rms(embeds, w[f"{layer}.input_layernorm.weight"]),
                   rms(hidden, w[f"{layer}.hidden_norm.weight"])], dim=-1)  # fmt: skip
    q, k, v = (proj(x, f"self_attn.{n}_proj").view(t, -1, hd) for n in "qkv")
    angle = positions[:, None, None] / cfg.rope_theta ** (torch.arange(0, hd, 2) / hd)
    cos, sin = angle.cos(), angle.sin()

    def rope(z):  # HF rotate_half
        z1, z2 = z.chunk(2, dim=-1)
        return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], dim=-1)

    q, k = rope(q), rope(k)
    k, v = (z.repeat_interleave(nh // nkv, dim=1) for z in (k, v))
    attn = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    h = proj(attn.transpose(0, 1).reshape(t, nh * hd), "self_attn.o_proj") + hidden
    m = rms(h, w[f"{layer}.post_attention_layernorm.weight"])
    out = proj(torch.nn.functional.silu(proj(m, "mlp.gate_proj")) * proj(m, "mlp.up_proj"),
               "mlp.down_proj") + h  # fmt: skip
    return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


def causal_attend(q, k, v):  # [T, heads | kv, hd] -> [T, heads * hd]
    rep = q.shape[1] // k.shape[1]
    k, v = (z.repeat_interleave(rep, dim=1).transpose(0, 1) for z in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("layout,layer", [("sglang", "midlayer"), ("vllm", "layers.0")])
def test_loaded_drafter_computes_what_the_engines_compute(tmp_path, target, layout, layer):
    """The files mean what SGLang's (and vLLM's default) EAGLE-3 layer does with them: a
    forward written from the saved tensors gives outrider's logits and fed-back hidden."""
    draft = random_drafter(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(0.05)  # keep activations in a range where fp32 sums agree tightly
    path = save_drafter(draft, tmp_path / "d", layout)
    with safe_open(path / "model.safetensors", "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    loaded = load_drafter(path, target)
    t = 7
    embeds, aux = torch.randn(t, 128), torch.randn(t, 3 * 128)
    positions = torch.arange(t)
    with torch.no_grad():
        normed, summed = loaded(torch.zeros(t, dtype=torch.long), positions, aux, causal_attend,
                                embeds)  # fmt: skip
        logits = loaded.compute_logits(normed)
        ref_logits, ref_summed = sglang_reference(w, loaded.config, layer, embeds, aux, positions)
    torch.testing.assert_close(summed, ref_summed, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)


def test_aux_id_conventions():
    assert engine_aux_ids((2, 15, 27), "sglang") == [1, 14, 26]
    assert engine_aux_ids((2, 15, 27), "vllm") == [2, 15, 27]
    assert engine_aux_ids((2, 15, 27), "speculators") == [2, 15, 27]  # vLLM reads them as given
    for layout in ("sglang", "vllm", "speculators"):
        assert outrider_aux_layers(engine_aux_ids((2, 15, 27), layout), layout) == (2, 15, 27)
    with pytest.raises(ValueError, match=r"layout='trtllm' is unknown"):
        engine_aux_ids((2, 15, 27), "trtllm")


def test_loads_foreign_files(tmp_path, target, draft):
    """Files outrider did not write: no outrider record, either layer spelling, `model.`
    prefixes, no explicit ids, a shipped embedding, and d2t without t2d."""
    path = save_drafter(draft, tmp_path / "d", "sglang")

    def foreign(cfg):
        del cfg["outrider"]
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}

    def respell(ts):
        for k in list(ts):
            if k.startswith("midlayer."):
                ts["model.layers.0." + k.removeprefix("midlayer.")] = ts.pop(k)
        ts["embed_tokens.weight"] = torch.zeros(512, 128)
        del ts["t2d"]

    edit(path, foreign, respell)
    assert resolve_layout(json.loads((path / "config.json").read_text())) == "sglang"
    assert_same(draft, load_drafter(path, target))  # t2d derived from d2t, embedding ignored
    edit(path, lambda c: c.pop("eagle_config"))  # no ids: the engines' default, same as ours
    assert load_drafter(path, target).config.aux_layers == (2, 4, 5)
    # Only a top-level id list: only vLLM reads it, so the file is vLLM's.
    edit(path, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert resolve_layout(json.loads((path / "config.json").read_text())) == "vllm"
    assert load_drafter(path, target).config.aux_layers == (2, 4, 5)
    # Told it is SGLang's, the file is read as SGLang reads it: top-level ids unseen, defaults.
    assert load_drafter(path, target, layout="sglang").config.aux_layers == (2, 4, 5)


def test_missing_d2t_is_identity_only_for_a_full_vocabulary(tmp_path, target):
    full = random_drafter(target, draft_vocab=512)
    full.d2t.zero_()
    full.t2d.fill_(True)
    path = save_drafter(full, tmp_path / "full")
    edit(path, tensors=lambda ts: (ts.pop("d2t"), ts.pop("t2d")))
    assert_same(full, load_drafter(path, target))
    path = save_drafter(random_drafter(target), tmp_path / "small")
    edit(path, tensors=lambda ts: ts.pop("d2t"))
    with pytest.raises(ValueError, match="has no d2t but draft_vocab_size=64 < vocab_size=512"):
        load_drafter(path, target)


# fmt: off
REFUSED = [
    (lambda c: c.update(target_hidden_size=256), None, "target_hidden_size=256 but the target"),
    (lambda c: c.update(vocab_size=600), None, "vocab_size=600 but the target's vocabulary"),
    (
        lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8]),
        None,
        r"outrider.aux_layers says \[2, 4, 5\]",
    ),
    (
        lambda c: (c.pop("outrider"), c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8])),
        None,
        r"aux layers \[2, 4, 9\] .* must be distinct layer indices in 0\.\.7",
    ),
    (lambda c: c.update(draft_vocab_size=32), None, r"lm_head.weight is \(64, 128\), .* \(32, 128\)"),
    (lambda c: c.update(num_hidden_layers=2), None, "num_hidden_layers=2"),
    (lambda c: c.update(norm_before_residual="yes"), None, "norm_before_residual=.yes.: set true or false"),
    (None, lambda ts: ts.update({"fc.bias": torch.zeros(128)}), r"no place for: \['fc.bias'\]"),
    (lambda c: c.pop("hidden_size"), None, r"lacks \['hidden_size'\]"),
    (None, lambda ts: ts.pop("midlayer.mlp.up_proj.weight"), r"lacks 1 drafter tensor.*up_proj"),
    (None, lambda ts: ts.update(d2t=ts["d2t"] + 500), "outside the target vocabulary"),
    (None, lambda ts: ts.update({"layers.1.hidden_norm.weight": ts["norm.weight"].clone()}), "second decoder layer"),
]
# fmt: on


@pytest.mark.parametrize("change,tensors,match", REFUSED)
def test_refuses_what_does_not_fit(tmp_path, target, draft, change, tensors, match):
    path = save_drafter(draft, tmp_path / "d")
    edit(path, change, tensors)
    with pytest.raises(ValueError, match=match):
        load_drafter(path, target)


def test_corrupt_or_missing_files_are_named(tmp_path, target, draft):
    path = save_drafter(draft, tmp_path / "d")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors' is not a readable safetensors file"):
        load_drafter(path, target)
    weights.unlink()
    (path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="pickle weights"):
        load_drafter(path, target)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_drafter(path, target)
    with pytest.raises(FileNotFoundError, match="pass an EAGLE-3 drafter directory"):
        load_drafter(tmp_path / "nowhere", target)


def test_save_replaces_a_drafter_but_nothing_else(tmp_path, target, draft):
    path = save_drafter(draft, tmp_path / "d", extra={"target_sha256": "ab12", "steps": 10})
    other = random_drafter(target, seed=1)
    save_drafter(other, path, "vllm")  # an existing drafter directory is replaced whole
    assert_same(other, load_drafter(path, target))
    assert "target_sha256" not in json.loads((path / "config.json").read_text())["outrider"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not an EAGLE-3 drafter directory"):
        save_drafter(draft, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match=r"extra may not set \['layout'\]"):
        save_drafter(draft, tmp_path / "e", extra={"layout": "x"})
    with pytest.raises(ValueError, match="JSON-serializable"):
        save_drafter(draft, tmp_path / "e", extra={"t": torch.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "notes"]


def test_extra_is_recorded(tmp_path, draft):
    path = save_drafter(draft, tmp_path / "d", extra={"target_sha256": "ab12", "steps": 10})
    own = json.loads((path / "config.json").read_text())["outrider"]
    assert own == {
        "format_version": 1,
        "layout": "sglang",
        "aux_layers": [2, 4, 5],
        "target_sha256": "ab12",
        "steps": 10,
    }
