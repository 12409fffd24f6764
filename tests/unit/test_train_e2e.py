"""The whole pipeline on a tiny random target: datagen -> train (the loss falls) -> save ->
load -> an interrupted run resumed from its checkpoint continues exactly; bad inputs fail
with errors that say what to do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from outrider import LLM
from outrider.models.eagle3_io import load_drafter
from outrider.train.config import TrainConfig
from outrider.train.datagen import generate_dataset
from outrider.train.seed_prompts import SEED_PROMPTS
from outrider.train.trainer import train
from tests.tiny import hf_reference, tiny_hf_config

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_target(path, seed: int = 0):
    cfg = tiny_hf_config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=8, eos_token_id=4,
    )  # fmt: skip
    ref = hf_reference(cfg, seed=seed)
    with torch.no_grad():
        ref.lm_head.weight.mul_(8.0)  # a peaked target: something a drafter can learn fast
    ref.save_pretrained(path, safe_serialization=True)
    save_chat_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = _tiny_target(tmp_path_factory.mktemp("tiny-target"))
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=256, block_size=16)
    return path, llm


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory):
    _, llm = target
    out = tmp_path_factory.mktemp("data") / "data.jsonl"
    generate_dataset(llm, out, num_samples=12, max_new_tokens=16, batch_size=12)
    return out


def _config(data, out, **over) -> TrainConfig:
    base = dict(
        data=str(data), output_dir=str(out), device="cpu", dtype="float32",
        draft_vocab_size=256, ttt_steps=3, max_len=64, batch_rows=2, max_steps=24,
        lr=3e-3, warmup_ratio=0.1, checkpoint_every=6, log_every=1, init_std=0.05,
    )  # fmt: skip
    base.update(over)
    return TrainConfig(**base)


def test_dataset_records(dataset):
    recs = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert len(recs) == 12 and len({r["id"] for r in recs}) == 12
    for r in recs:
        assert len(r["input_ids"]) == len(r["loss_mask"])
        # the prompt (mask 0) comes first, then the target's answer (mask 1)
        first = r["loss_mask"].index(1)
        assert first > 0 and all(r["loss_mask"][first:])


@pytest.fixture(scope="module")
def whole_run(target, dataset, tmp_path_factory):
    _, llm = target
    return train(_config(dataset, tmp_path_factory.mktemp("whole")), llm=llm)


@pytest.mark.slow
def test_train_loss_falls_and_drafter_round_trips(target, whole_run):
    _, llm = target
    result = whole_run
    assert result.step == 24 and len(result.losses) == 24
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    loaded = load_drafter(result.drafter, llm.engine.runner.model_config)
    trained = result.draft.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name].detach()), name
    assert int(loaded.t2d.sum()) == 256


@pytest.mark.slow
def test_resume_continues_exactly(target, dataset, whole_run, tmp_path):
    _, llm = target

    class Crash(Exception):
        pass

    def crash_at_7(step, _metrics):
        if step == 7:  # one step past the checkpoint at 6: that step is lost and redone
            raise Crash

    with pytest.raises(Crash):
        train(_config(dataset, tmp_path / "cut"), llm=llm, callback=crash_at_7)
    assert sorted(p.name for p in (tmp_path / "cut").glob("step-*")) == ["step-00000006"]
    resumed = train(_config(dataset, tmp_path / "cut", resume=True), llm=llm)
    assert resumed.step == 24
    assert resumed.losses == whole_run.losses[6:]
    whole = whole_run.draft.state_dict()
    for name, tensor in resumed.draft.state_dict().items():
        assert torch.equal(tensor, whole[name]), name


@pytest.mark.slow
def test_fine_tuning_starts_from_the_drafter_and_keeps_its_vocabulary(
    target, dataset, whole_run, tmp_path
):
    from outrider.train.trainer import Trainer

    _, llm = target
    init = load_drafter(whole_run.drafter, llm.engine.runner.model_config)
    # draft_vocab_size None would build min(32000, vocab) slots from the data: init's are kept.
    tuner = Trainer(_config(dataset, tmp_path / "ft", draft_vocab_size=None, max_steps=3,
                            init_from=str(whole_run.drafter)), llm)  # fmt: skip
    params = dict(tuner.draft.named_parameters())
    for name, tensor in init.named_parameters():
        assert torch.equal(params[name].detach(), tensor.float()), name
    result = tuner.run()
    assert torch.equal(result.draft.d2t.cpu(), init.d2t) and int(result.draft.t2d.sum()) == 256
    # It starts where the drafter ended, not from a random draft's loss.
    assert result.losses[0] < 0.8 * whole_run.losses[0], (result.losses, whole_run.losses[:3])
    with pytest.raises(ValueError, match="fine-tuning keeps the drafter's vocabulary"):
        Trainer(_config(dataset, tmp_path / "ft2", draft_vocab_size=128,
                        init_from=str(whole_run.drafter)), llm)  # fmt: skip
    with pytest.raises(ValueError, match="drop one of them"):
        _config(dataset, tmp_path / "ft3", init_from=str(whole_run.drafter), head_from_target=True)
    # A drafter serving would refuse (made for another model) is refused before training.
    from outrider.loaders.hf_config import TransformerConfig
    from outrider.models.eagle3_io import save_drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    other = TransformerConfig.from_hf_dict(tiny_hf_config(hidden_size=32, intermediate_size=64))
    path = save_drafter(random_drafter(other, draft_vocab=64), tmp_path / "other", "sglang")
    with pytest.raises(ValueError, match="does not fit this target"):
        Trainer(_config(dataset, tmp_path / "ft4", draft_vocab_size=None, init_from=str(path)), llm)


def test_head_from_target_starts_the_draft_head_as_the_targets(target, dataset, tmp_path):
    from outrider.train.trainer import Trainer

    _, llm = target
    model = llm.engine.runner.model
    trainer = Trainer(_config(dataset, tmp_path / "h", head_from_target=True), llm)
    draft = trainer.draft
    ids = torch.arange(draft.d2t.numel()) + draft.d2t
    assert torch.equal(draft.lm_head.weight, model.lm_head.weight[ids].float())
    assert torch.equal(draft.norm.weight, model.model.norm.weight.float())
    assert draft.lm_head.weight.requires_grad
    plain = Trainer(_config(dataset, tmp_path / "p"), llm).draft
    assert not torch.allclose(plain.lm_head.weight, draft.lm_head.weight)


def test_a_wider_drafter_trains_saves_and_loads_at_its_width(target, dataset, tmp_path):
    _, llm = target
    result = train(_config(dataset, tmp_path / "w", max_steps=2, intermediate_size=200), llm=llm)
    config = json.loads((result.drafter / "config.json").read_text())
    assert config["intermediate_size"] == 200
    loaded = load_drafter(result.drafter, llm.engine.runner.model_config)
    assert loaded.config.intermediate_size == 200
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, result.draft.state_dict()[name].detach()), name
    with pytest.raises(ValueError, match="intermediate_size"):
        _config(dataset, tmp_path / "x", intermediate_size=200, init_from=str(result.drafter))
    for bad in ({"hard_label": 1.5}, {"align_topk": -1}, {"intermediate_size": 0}):
        with pytest.raises(ValueError, match=f"invalid {next(iter(bad))}="):
            _config(dataset, tmp_path / "x", **bad)


@pytest.mark.slow
def test_a_drafter_on_chosen_aux_layers_trains_exports_and_serves_on_them(
    target, dataset, tmp_path
):
    """aux_layers (1, 3, 7) instead of the default (2, 4, 5) of the 8-layer target: training
    captures exactly those residual streams (HF hidden_states[i]), every export names them in
    its engine's convention, and serving captures the same ones: the offline chain replay,
    which reads the drafter's layers, equals what the engine accepts."""
    from transformers import AutoModelForCausalLM

    from outrider import SamplingParams
    from outrider.models.eagle3_io import save_drafter
    from outrider.speculative.eagle3_doctor import require_fit
    from outrider.train.capture import TargetCapture
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import replay_chain

    path, llm = target
    aux = (1, 3, 7)
    assert tuple(llm.engine.runner.model_config.aux_hidden_layers) != aux
    ids = read_samples(dataset)[0].input_ids.tolist()
    feats = TargetCapture(llm, aux).features([ids]).aux
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in aux], dim=-1)
    assert (feats - want).abs().max().item() < 1e-4

    result = train(_config(dataset, tmp_path / "a", aux_layers=aux), llm=llm)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.8 * first, result.losses
    config = json.loads((result.drafter / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]  # SGLang: i - 1
    vllm = save_drafter(load_drafter(result.drafter, llm.engine.runner.model_config),
                        tmp_path / "vllm", "vllm")  # fmt: skip
    vllm_config = json.loads((vllm / "config.json").read_text())
    assert vllm_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]  # vLLM: i
    for d in (result.drafter, vllm):
        require_fit(d, llm.engine.checkpoint, "unexpected", "")
        assert load_drafter(d, llm.engine.runner.model_config).config.aux_layers == aux

    samples = read_samples(dataset)
    served_draft = load_drafter(vllm, llm.engine.runner.model_config)
    replay = replay_chain(served_draft, llm, samples, k=3)
    spec = LLM(str(path), dtype="float32", device="cpu", num_blocks=256,
               speculative={"method": "eagle3", "controller": "fixed", "draft": str(vllm), "num_draft_tokens": 3})  # fmt: skip
    answers = [s.input_ids[len(s.prompt()) :].tolist() for s in samples]
    params = [SamplingParams(temperature=0, max_tokens=len(a), ignore_eos=True) for a in answers]
    outs = spec.generate([s.prompt() for s in samples], params)
    assert [o.token_ids for o in outs] == answers  # lossless
    served = (sum(o.metrics["num_accepted_tokens"] for o in outs),
              sum(o.metrics["num_verify_steps"] for o in outs))  # fmt: skip
    assert replay.accepted > 0 and (replay.accepted, replay.verify_steps) == served


def test_aux_layers_that_do_not_fit_are_refused(target, dataset, tmp_path):
    _, llm = target
    with pytest.raises(ValueError, match=r"aux layers \[1, 3, 8\].*0\.\.7"):
        train(_config(dataset, tmp_path / "r", aux_layers=(1, 3, 8)), llm=llm)
    with pytest.raises(ValueError, match="invalid aux_layers="):
        _config(dataset, tmp_path / "r", aux_layers=(1, 3))
    with pytest.raises(ValueError, match="own aux layers: drop one"):
        _config(dataset, tmp_path / "r", aux_layers=(1, 3, 7), init_from=str(tmp_path))
    # A feature cache of the default layers is not read for others,
    cache = tmp_path / "cache"
    train(_config(dataset, tmp_path / "a", max_steps=2, feature_cache=str(cache)), llm=llm)
    with pytest.raises(ValueError, match=r"feature cache .* aux layers \[2, 4, 5\].*\[1, 3, 7\]"):
        train(_config(dataset, tmp_path / "b", max_steps=2, feature_cache=str(cache),
                      aux_layers=(1, 3, 7)), llm=llm)  # fmt: skip
    # ...and a checkpoint of them does not resume on others.
    run = tmp_path / "run"
    train(_config(dataset, run, max_steps=2, checkpoint_every=2), llm=llm)
    with pytest.raises(ValueError, match=r"trained on aux layers \[2, 4, 5\]"):
        train(_config(dataset, run, max_steps=4, resume=True, aux_layers=(1, 3, 7)), llm=llm)


def test_bad_inputs_fail_clearly(target, dataset, tmp_path):
    path, llm = target
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no samples"):
        train(_config(empty, tmp_path / "e"), llm=llm)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train(_config(dataset, tmp_path / "v", draft_vocab_size=4096), llm=llm)

    # A checkpoint made for this target...
    run = tmp_path / "run"
    train(_config(dataset, run, max_steps=2, checkpoint_every=2), llm=llm)
    # ...refuses another target of the same shape,
    other = _tiny_target(tmp_path / "other", seed=7)
    other_llm = LLM(str(other), dtype="float32", device="cpu", num_blocks=64)
    with pytest.raises(ValueError, match="another target"):
        train(_config(dataset, run, max_steps=4, resume=True), llm=other_llm)
    # ...and, corrupted, says so and what to do.
    ckpt = next(run.glob("step-*"))
    shutil.copy(ckpt / "model.safetensors", tmp_path / "good.safetensors")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt.*resume=False"):
        train(_config(dataset, run, max_steps=4, resume=True), llm=llm)
    shutil.copy(tmp_path / "good.safetensors", ckpt / "model.safetensors")
    (ckpt / "optimizer.safetensors").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        train(_config(dataset, run, max_steps=4, resume=True), llm=llm)


@pytest.mark.slow
def test_evaluate_and_cli_export(target, dataset, whole_run, tmp_path, capsys):
    import argparse

    from outrider.train.cli import _config, add_drafter_parser, cmd_drafter
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import (
        confidence_profile,
        estimated_accept_length,
        evaluate_drafter,
    )

    path, llm = target
    samples = read_samples(dataset)[-4:]
    res = evaluate_drafter(whole_run.draft, llm, samples, ttt_steps=3, max_len=64, batch_rows=2)
    assert len(res.step_acc) == 3 and all(0 <= a <= 1 for a in res.step_acc)
    assert res.num_tokens > 0
    assert estimated_accept_length([0.8, 0.6]) == pytest.approx(2.28)
    # The confidence buckets cover the same tokens and, weighted, give the first step's accuracy.
    prof = confidence_profile(whole_run.draft, llm, samples, max_len=64, batch_rows=2)
    assert prof.num_tokens == res.num_tokens
    assert sum(prof.share) + prof.outside == pytest.approx(1.0)
    weighted = sum(s * a for s, a in zip(prof.share, prof.acc))
    assert weighted == pytest.approx(res.step_acc[0], abs=1e-6)
    assert sum(1 for s in prof.share if s > 0) >= 2  # the tiny target is not always sure
    one = confidence_profile(whole_run.draft, llm, samples, max_len=64, edges=(0.0, 1.0))
    assert one.share[0] == pytest.approx(1.0 - prof.outside)

    parser = argparse.ArgumentParser()
    add_drafter_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["drafter", "train", "--data", "x.jsonl", "--no-resume"])
    assert _config(TrainConfig, args) == TrainConfig(data="x.jsonl")
    out = tmp_path / "vllm"
    args = parser.parse_args(
        ["drafter", "export", str(whole_run.drafter), str(out), "--format", "vllm",
         "--model", str(path)]
    )  # fmt: skip
    assert cmd_drafter(args) == 0
    assert json.loads((out / "config.json").read_text())["outrider"]["layout"] == "vllm"
    loaded = load_drafter(out, llm.engine.runner.model_config)
    trained = whole_run.draft.state_dict()
    assert all(torch.equal(t, trained[n]) for n, t in loaded.state_dict().items())
    bad = parser.parse_args(["drafter", "export", str(tmp_path / "nope"), str(out)])
    assert cmd_drafter(bad) == 2

    # Drafters ship in bf16; `drafter eval` runs them in the target's dtype (fp32 here).
    from outrider.models.eagle3_io import save_drafter

    half = tmp_path / "bf16"
    save_drafter(whole_run.draft.to(torch.bfloat16), half)
    args = parser.parse_args(
        ["drafter", "eval", "--drafter", str(half), "--data", str(dataset), "--model",
         str(path), "--dtype", "float32", "--device", "cpu", "--num-samples", "2",
         "--ttt-steps", "2", "--max-len", "64"]
    )  # fmt: skip
    assert cmd_drafter(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["samples"] == 2 and len(report["step_acc"]) == 2
    assert report["replayed_chain4_accept_length"] >= 1.0
    conf = report["by_target_confidence"]
    assert conf["target_top1_prob"][0] == "0-0.3" and len(conf["share"]) == 5


def test_greedy_samples_are_what_datagen_writes(target, dataset):
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import greedy_samples

    _, llm = target
    written = {s.id: s for s in read_samples(dataset)}
    got = greedy_samples(llm, SEED_PROMPTS[:3], max_tokens=16)
    for i, s in enumerate(got):
        want = written[f"seed-{i}"]
        assert torch.equal(s.input_ids, want.input_ids)
        assert torch.equal(s.loss_mask, want.loss_mask) and bool(s.loss_mask.any())


def test_datagen_sources_and_resume(target, tmp_path):
    _, llm = target
    user = tmp_path / "user.jsonl"
    user.write_text(
        json.dumps({"prompt": "Why is the sky blue?"}) + "\n"
        + json.dumps({"conversations": [
            {"from": "human", "value": "Write a haiku about autumn leaves."},
            {"from": "gpt", "value": "an answer that is regenerated"},
            {"from": "human", "value": "Now make it rhyme."},
        ]}) + "\n"
    )  # fmt: skip
    out = tmp_path / "d.jsonl"
    kw = dict(num_samples=4, max_new_tokens=6, seed_prompts=False, self_generated=2,
              user_file=user, batch_size=4)  # fmt: skip
    generate_dataset(llm, out, **kw)
    recs = {json.loads(line)["id"]: json.loads(line) for line in out.read_text().splitlines()}
    # A random target's Magpie turns ramble past MAGPIE_MAX_TOKENS and are dropped.
    assert {"user-1", "user-2"} <= set(recs) <= {"user-1", "user-2", "self-0", "self-1"}
    # Both turns regenerated; the first keeps its mask only when the template re-renders the
    # generated tokens unchanged (a random model's 6 tokens do not end the turn: they do not).
    two, one = recs["user-2"], recs["user-1"]
    assert two["loss_mask"][-6:] == [1] * 6 and len(two["input_ids"]) > len(one["input_ids"])
    # A crash mid-write leaves half a line: it is dropped and that sample regenerated.
    text = out.read_text()
    out.write_text(text[: len(text) - 20])
    generate_dataset(llm, out, **kw)
    assert out.read_text() == text

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no user turns"):
        generate_dataset(llm, out, **{**kw, "user_file": empty})


def test_datagen_shards_make_the_same_dataset(target, tmp_path):
    _, llm = target
    kw = dict(num_samples=5, max_new_tokens=5, self_generated=0, batch_size=2)
    generate_dataset(llm, tmp_path / "whole.jsonl", **kw)
    parts = []
    for i in range(2):
        generate_dataset(llm, tmp_path / f"part{i}.jsonl", shard=(i, 2), **kw)
        parts += (tmp_path / f"part{i}.jsonl").read_text().splitlines()
    whole = (tmp_path / "whole.jsonl").read_text().splitlines()
    assert len(whole) == 5 and sorted(parts) == sorted(whole)
    with pytest.raises(ValueError, match="shard"):
        generate_dataset(llm, tmp_path / "x.jsonl", shard=(2, 2), **kw)


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _ScriptedLLM:
    """Answers Magpie calls with scripted turns, so the opener / cap / exclusion logic is
    tested on its own: a real target's turns are what the other datagen tests run."""

    def __init__(self, turns):
        from types import SimpleNamespace

        self.engine = SimpleNamespace(max_model_len=4096, tokenizer=_CharTokenizer())
        self.turns, self.magpie_prompts, self.magpie_params = turns, [], []

    def apply_chat_template(self, messages, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )

    def encode_chat_text(self, text):
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts, params):
        from types import SimpleNamespace

        if params[0].stop:  # the Magpie call: one scripted (text, finish_reason) per prompt
            self.magpie_prompts = [self.engine.tokenizer.decode(p) for p in prompts]
            self.magpie_params = params
            return [SimpleNamespace(text=t, finish_reason=f) for t, f in self.turns]
        return [SimpleNamespace(token_ids=[5, 6, 7]) for _ in prompts]


def test_magpie_turns_start_from_openers_and_drop_rambling_and_excluded(tmp_path):
    from outrider.train.datagen import MAGPIE_OPENERS, magpie_opener

    openers = [magpie_opener(f"self-{i}") for i in range(400)]
    assert 60 <= openers.count("") <= 140  # one id in four writes unprompted
    assert set(openers) - {""} <= set(MAGPIE_OPENERS) and len(set(openers)) > 50
    ids = [f"self-{i}" for i in range(6)]
    fake = _ScriptedLLM([
        (" about the sea.", "stop"), (" and on and on", "length"), (" stop here", "stop"),
        (" something else entirely", "stop"), ("  ", "stop"), ("Hi there.", "stop"),
    ])  # fmt: skip
    want = [magpie_opener(i) for i in ids]
    assert want[4] and not want[5]  # self-4 continues an opener, self-5 writes unprompted
    excluded = (want[2] + " stop here").upper()  # case and spacing do not matter
    out = tmp_path / "m.jsonl"
    generate_dataset(fake, out, num_samples=6, max_new_tokens=3, seed_prompts=False,
                     exclude=[f"  {excluded} "])  # fmt: skip
    assert [p.endswith(o) for p, o in zip(fake.magpie_prompts, want)] == [True] * 6
    # Openers are continued to the end of their line; unprompted turns may run over lines.
    assert ["\n" in p.stop for p in fake.magpie_params] == [True] * 5 + [False]
    assert {(p.temperature, p.top_p) for p in fake.magpie_params} == {(0.7, 0.9)}
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    # Rambling, excluded and an opener with nothing added are dropped.
    assert [r["id"] for r in recs] == ["self-0", "self-3", "self-5"]
    prompt = _CharTokenizer().decode(recs[0]["input_ids"][:-3])
    assert prompt == f"<user>{(want[0] + ' about the sea.').strip()}</user><assistant>"
    assert recs[0]["loss_mask"][-3:] == [1, 1, 1] and not any(recs[0]["loss_mask"][:-3])


def test_composed_requests_in_the_data_without_near_duplicates_of_excluded(tmp_path):
    from outrider.train.composed import compose_prompts

    want = compose_prompts(5)
    fake = _ScriptedLLM([])
    out = tmp_path / "c.jsonl"
    # A held-out prompt a word and some punctuation away from the second composed request.
    near = want[1].upper().rstrip(".?") + ", please!"
    generate_dataset(fake, out, num_samples=7, max_new_tokens=3, seed_prompts=False,
                     composed=5, self_generated=0, exclude=[near])  # fmt: skip
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["comp-0", "comp-2", "comp-3", "comp-4"]
    prompt = _CharTokenizer().decode(recs[0]["input_ids"][:-3])
    assert prompt == f"<user>{want[0]}</user><assistant>"


@pytest.mark.slow
def test_offline_chain_replay_equals_the_engine(target, dataset, whole_run):
    """Training and serving read the same rows: the chain replayed on TTT outputs accepts
    exactly what the engine accepts, step for step, on the target's own greedy answers."""
    from outrider import SamplingParams
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import replay_chain

    path, llm = target
    samples = read_samples(dataset)
    served_draft = load_drafter(whole_run.drafter, llm.engine.runner.model_config)
    replay = replay_chain(served_draft, llm, samples, k=3)
    spec = LLM(str(path), dtype="float32", device="cpu", num_blocks=256,
               speculative={"method": "eagle3", "controller": "fixed", "draft": str(whole_run.drafter),
                            "num_draft_tokens": 3})  # fmt: skip
    answers = [s.input_ids[len(s.prompt()) :].tolist() for s in samples]
    params = [SamplingParams(temperature=0, max_tokens=len(a), ignore_eos=True) for a in answers]
    outs = spec.generate([s.prompt() for s in samples], params)
    assert [o.token_ids for o in outs] == answers  # the samples are the target's greedy answers
    served = (sum(o.metrics["num_accepted_tokens"] for o in outs),
              sum(o.metrics["num_verify_steps"] for o in outs))  # fmt: skip
    assert replay.accepted > 0 and (replay.accepted, replay.verify_steps) == served


@pytest.mark.slow
def test_trained_drafter_serves_losslessly(target, dataset, whole_run):
    from outrider import SamplingParams
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import serving_accept_length

    path, llm = target
    spec = LLM(str(path), dtype="float32", device="cpu", num_blocks=256,
               speculative={"method": "eagle3", "controller": "fixed", "draft": str(whole_run.drafter),
                            "num_draft_tokens": 3})  # fmt: skip
    prompts = [s.prompt() for s in read_samples(dataset)[:4]]
    params = SamplingParams(temperature=0, max_tokens=8)
    assert serving_accept_length(spec, prompts, params) > 1.0
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in llm.generate(prompts, params)
    ]
    with pytest.raises(ValueError, match="speculative"):
        serving_accept_length(llm, prompts, params)


def test_feature_cache_round_trip(target, dataset, tmp_path):
    _, llm = target
    cache = tmp_path / "cache"
    first = train(_config(dataset, tmp_path / "a", max_steps=3, feature_cache=str(cache)), llm=llm)
    assert list(cache.glob("shard-*.safetensors")) and (cache / "index-0.json").is_file()
    again = train(_config(dataset, tmp_path / "b", max_steps=3, feature_cache=str(cache)), llm=llm)
    # Cached features are bf16: the same run up to that rounding.
    assert again.losses == pytest.approx(first.losses, rel=2e-2)


def test_epochs_that_pack_into_fewer_batches_do_not_overrun(target, dataset, tmp_path, monkeypatch):
    """Later epochs reshuffle and may pack into fewer rows than epoch 0 (seen on a GPU run:
    IndexError at the end of an epoch); training runs on through them."""
    import outrider.train.trainer as trainer_mod

    _, llm = target
    real = trainer_mod.pack_rows

    def shrinking(samples, max_len, seed, epoch):
        rows = real(samples, max_len, seed, epoch)
        return rows if epoch == 0 else rows[: max(2, len(rows) - 2 * epoch)]

    monkeypatch.setattr(trainer_mod, "pack_rows", shrinking)
    per_epoch = len(trainer_mod.micro_batches(real(trainer_mod.read_samples(dataset), 64, 0, 0), 2))
    result = train(_config(dataset, tmp_path / "run", max_steps=3 * per_epoch), llm=llm)
    assert result.step == 3 * per_epoch


@pytest.mark.slow
def test_time_budget_stops_training_on_a_decayed_rate(target, dataset, tmp_path):
    """max_minutes ends the run by the clock: fewer steps than max_steps, the drafter and a
    checkpoint written, and the learning rate at the end already decayed by the clock."""
    from outrider.train.trainer import lr_at

    _, llm = target
    config = _config(dataset, tmp_path / "run", max_steps=10_000, max_minutes=0.05, log_every=5)
    result = train(config, llm=llm)
    assert 1 <= result.step < 10_000 and result.drafter is not None
    assert len(result.losses) == result.step
    state = json.loads((tmp_path / "run" / f"step-{result.step:08d}" / "state.json").read_text())
    assert state["elapsed_s"] >= 3.0
    # the schedule by the clock: warmup, the top, then cosine down to min_lr_ratio * lr
    assert lr_at(0, 10_000, config, time_frac=0.05) == pytest.approx(config.lr * 0.5)
    assert lr_at(0, 10_000, config, time_frac=0.1) == pytest.approx(config.lr)
    assert lr_at(5, 10_000, config, time_frac=1.0) == pytest.approx(config.min_lr_ratio * config.lr)
    assert lr_at(5, 10_000, config) == pytest.approx(config.lr * 6 / 1000)  # steps alone


def save_chat_tokenizer(path) -> None:
    """A byte-level BPE over the seed prompts with ChatML's special tokens, beside a model."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials)
    tok.train_from_iterator(list(SEED_PROMPTS) * 2 + ["user assistant system"], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHATML})
    )
