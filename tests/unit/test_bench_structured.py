"""benchmarks/structured.py: validity of outputs against a schema, regex or choice, the batches a
timed run sends (with each request's constraint and seed), the rows and tables a sweep
assembles; and the whole benchmark on a tiny random model on the CPU, whose constrained outputs
must all be valid (that needs the engine to enforce structured_outputs)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from outrider.engine.structured import GrammarCounters
from outrider.speculative.stats import SpecStats
from tests.benchmarks import load_benchmark

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer",
                   "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("structured.py")


@pytest.fixture(scope="module")
def cases_mod():
    return load_benchmark("structured_cases.py")


@pytest.fixture
def cases(cases_mod):
    Case = cases_mod.Case
    return [
        Case("person", "json", PERSON, "a person as JSON", '{"name": "Al", "age": 3}'),
        Case("zip", "regex", "[0-9]{5}", "a zip code", "12345"),
        Case("mood", "choice", ("happy", "sad"), "happy or sad?", "sad"),
    ]


def test_validity_of_json_regex_and_choice(cases):
    person, zipcode, mood = cases
    assert person.is_valid('{"name": "Al", "age": 3}')
    assert person.is_valid(' {"age": 3, "name": "Al"}\n')  # JSON, whatever its layout
    assert not person.is_valid('{"name": "Al", "age": 130}')  # over the maximum
    assert not person.is_valid('{"name": "Al"}')  # a required field missing
    assert not person.is_valid('{"name": "Al", "age": 3, "x": 1}')  # additionalProperties
    assert not person.is_valid('```json\n{"name": "Al", "age": 3}\n```')  # fenced: not JSON
    assert not person.is_valid('{"name": "Al", "age": 3')  # cut at max_tokens
    assert zipcode.is_valid("12345")
    assert not zipcode.is_valid("12345-") and not zipcode.is_valid("ZIP 12345")
    assert mood.is_valid("sad") and not mood.is_valid("Sad") and not mood.is_valid("sad.")


def test_structured_outputs_and_params_per_case(bench, cases):
    person, zipcode, mood = cases
    assert person.structured_outputs() == {"json": PERSON}
    assert zipcode.structured_outputs() == {"regex": "[0-9]{5}"}
    assert mood.structured_outputs() == {"choice": ["happy", "sad"]}
    greedy = bench.request_params(2, mood, True, 0.0, 50)
    assert greedy.seed is None and greedy.structured_outputs.choice == ("happy", "sad")
    sampled = bench.request_params(2, person, True, 0.8, 50)
    assert sampled.seed == 2 and json.loads(sampled.structured_outputs.json) == PERSON
    assert bench.request_params(1, zipcode, False, 0.8, 7).structured_outputs is None


def test_load_cases_caps_each_kind_and_refuses_duplicates(cases_mod, tmp_path):
    full = cases_mod.load_cases()
    kinds = [c.kind for c in full]
    assert kinds == sorted(kinds, key=["json", "regex", "choice"].index)  # schemas first
    two = cases_mod.load_cases(num_schemas=2)
    assert [c.kind for c in two] == ["json", "json", "regex", "regex", "choice", "choice"]
    assert [c.name for c in two[:2]] == [c.name for c in full[:2]]
    path = tmp_path / "dup.json"
    path.write_text(json.dumps({
        "schemas": [{"name": "a", "schema": PERSON, "prompt": "p", "example": {}}],
        "regex": [{"name": "a", "regex": "x", "prompt": "p", "example": "x"}],
    }))  # fmt: skip
    with pytest.raises(ValueError, match=r"\['a'\] appear more than once"):
        cases_mod.load_cases(path)


def test_validity_counts_and_fractions(bench, cases):
    texts = ['{"name": "Al", "age": 3}', "1234", "happy"]
    counts = bench.validity(cases, texts, [True, False, True])
    assert counts == {"n": 3, "valid": 2, "finished": 2, "valid_finished": 2, "invalid": ["zip"]}
    with pytest.raises(ValueError, match="3 cases, 2 outputs"):
        bench.validity(cases, texts[:2], [True, True])
    other = bench.validity(cases, ["{", "12345", "happy"], [False, True, True])
    row = bench.validity_row([counts, other])
    assert row == {
        "valid_fraction": round(4 / 6, 4),
        "valid_fraction_finished": 1.0,  # the invalid ones ran into max_tokens
        "finished_fraction": round(4 / 6, 4),
        "invalid": ["person", "zip"],
    }
    assert bench.validity_row([]) == {
        "valid_fraction": None, "valid_fraction_finished": None, "finished_fraction": None,
        "invalid": [],
    }  # fmt: skip


class FakeLLM:
    """LLM.chat's shape: records each batch's prompts and params; answers each case's example
    (or "nope" for the cases named in `wrong`), `tokens` ids each, as an engine that counts
    two verify steps of 4 drafts with 3 accepted per request."""

    def __init__(self, by_prompt: dict, wrong=(), tokens: int = 5):
        self.by_prompt, self.wrong, self.tokens = by_prompt, set(wrong), tokens
        self.batches = []
        runner = SimpleNamespace(run=lambda *a: None, run_spec=lambda *a: None,
                                 launch=lambda *a: None)  # fmt: skip
        spec = SimpleNamespace(stats=SpecStats(), steps_by_k={}, reset_stats=self._reset)
        grammars = SimpleNamespace(counters=GrammarCounters())
        self.engine = SimpleNamespace(
            runner=runner, speculator=spec, grammars=grammars, step=lambda: None,
            num_steps_run_ahead=0, num_steps_run_ahead_dropped=0, num_rows_run_ahead_redone=0,
        )  # fmt: skip

    def _reset(self):
        self.engine.speculator.stats = SpecStats()

    def chat(self, convs, params):
        self.batches.append([(c[0]["content"], p) for c, p in zip(convs, params)])
        self.engine.grammars.counters.picked_rows += len(convs)  # as if each picked a row
        self.engine.num_steps_run_ahead += 2 * len(convs)  # and ran ahead twice, one dropped
        self.engine.num_steps_run_ahead_dropped += len(convs)
        self.engine.num_rows_run_ahead_redone += 3 * len(convs)  # and redid three rows
        outs = []
        for conv in convs:
            case = self.by_prompt[conv[0]["content"]]
            self.engine.speculator.stats.record(4, 3)
            self.engine.speculator.stats.record(4, 3)
            text = "nope" if case.name in self.wrong else case.example
            # each request: its first token after 10 ms, the rest after 10 ms more
            metrics = {"time_to_first_token_s": 0.01, "e2e_latency_s": 0.02}
            outs.append(SimpleNamespace(text=text, token_ids=list(range(self.tokens)),
                                        finish_reason="stop", metrics=metrics))  # fmt: skip
        return outs


def test_timed_run_sends_full_batches_with_each_cases_params(bench, cases):
    llm = FakeLLM({c.prompt: c for c in cases}, wrong={"mood"})
    llm.engine.speculator.stats.record(4, 0)  # an earlier run's count: reset before timing
    row = bench.timed_run(llm, True, cases, 0.8, 2, 33, "cpu")
    assert [len(b) for b in llm.batches] == [2, 2]  # 3 cases cycled into two batches of 2
    sent = [(p, params) for b in llm.batches for p, params in b]
    assert [p for p, _ in sent] == [cases[i].prompt for i in (0, 1, 2, 0)]
    assert [params.seed for _, params in sent] == [0, 1, 2, 0]
    assert all(params.max_tokens == 33 and params.temperature == 0.8 for _, params in sent)
    assert sent[1][1].structured_outputs.regex == "[0-9]{5}"
    assert row["requests"] == 4 and row["tokens"] == 20
    assert row["validity_counts"]["valid"] == 3 and row["validity_counts"]["invalid"] == ["mood"]
    assert row["spec_stats"]["num_verify_steps"] == 8  # the reset dropped the earlier count
    assert row["spec_stats"]["num_accepted_tokens"] == 24
    assert row["accept_length"] == 4.0 and len(row["ids"]) == 4
    assert row["median_ttft_ms"] == 10.0
    assert row["decode_tok_per_s_stream"] == 400.0  # 4 tokens after the first in 10 ms
    assert row["grammar"]["picked_rows"] == 4 and row["grammar"]["late_masks"] == 0
    assert row["run_ahead"] == {"steps": 8, "dropped": 4, "rows_redone": 12}  # this run only
    free = bench.timed_run(FakeLLM({c.prompt: c for c in cases}), False, cases, 0.0, 4, 9, "cpu")
    assert free["requests"] == 4 and free["validity_counts"]["valid"] == 4
    # At least three batches of 4, the 3 cases cycled through them: a run long enough to time.
    many = FakeLLM({c.prompt: c for c in cases})
    row = bench.timed_run(many, True, cases, 0.0, 4, 9, "cpu", min_batches=3)
    assert [len(b) for b in many.batches] == [4, 4, 4] and row["requests"] == 12
    assert [p for b in many.batches for p, _ in b] == [cases[i % 3].prompt for i in range(12)]


def _run(tps: float, ids, valid: int, acc=None, around=()):
    counts = {"n": 4, "valid": valid, "finished": 4, "valid_finished": valid, "invalid": []}
    return {"tok_per_s": tps, "seconds": 400 / tps, "tokens": 400, "ids": ids,
            "accept_length": acc, "validity_counts": counts,
            "plain_around": list(around)}  # fmt: skip


def test_slot_rows_compare_with_plain_under_the_same_constraint(bench):
    plain_ids, fixed_ids = [[1, 2], [3, 4]], [[7, 8], [9, 9]]
    plains = [_run(100.0, plain_ids, 1), _run(80.0, plain_ids, 1), _run(120.0, plain_ids, 1)]
    tries = {
        ("plain", "constrained"): [_run(90.0, fixed_ids, 4, around=plains[:2]),
                                   _run(90.0, fixed_ids, 4, around=plains[1:])],
        ("ngram", "unconstrained"): [_run(180.0, [[1, 2], [3, 5]], 1, 2.0, plains[:2]),
                                     _run(200.0, [[1, 2], [3, 5]], 1, 2.0, plains[1:])],
        ("ngram", "constrained"): [_run(135.0, fixed_ids, 4, 1.5, plains[:2]),
                                   _run(150.0, [[7, 8], [0, 0]], 3, 1.5, plains[1:])],
    }  # fmt: skip
    rows = bench.slot_rows(plains, tries, greedy=True)
    assert set(rows) == {"plain", "ngram"}
    base = rows["plain"]["unconstrained"]
    assert base["tok_per_s"] == 100.0 and base["tok_per_s_runs"] == [100.0, 80.0, 120.0]
    assert base["valid_fraction"] == 0.25 and "ids" not in base
    fixed = rows["plain"]["constrained"]
    assert fixed["speedup_rounds"] == [1.0, 0.9]  # 90 over the mean of 100 and 80, then 80, 120
    assert fixed["speedup"] == 0.95 and fixed["valid_fraction"] == 1.0
    assert fixed["vs_unconstrained"] == 0.9 and "same_output_fraction" not in fixed
    ngram = rows["ngram"]["constrained"]
    # Identity against constrained plain (its first round), not unconstrained plain's ids.
    assert ngram["same_output_fraction"] == 1.0
    assert rows["ngram"]["unconstrained"]["same_output_fraction"] == 0.5
    assert ngram["valid_fraction"] == round(7 / 8, 4)  # both rounds counted
    assert ngram["tok_per_s"] == 142.5 and ngram["vs_unconstrained"] == round(142.5 / 190, 3)
    assert ngram["accept_length"] == 1.5
    assert "validity_counts" not in ngram and "ids" not in ngram
    sampled = bench.slot_rows(plains, tries, greedy=False)
    assert "same_output_fraction" not in sampled["ngram"]["constrained"]
    # decode alone over plain's under the same constraint (the last round's rates)
    tries[("plain", "constrained")][-1]["decode_tok_per_s_stream"] = 500.0
    tries[("ngram", "constrained")][-1]["decode_tok_per_s_stream"] = 900.0
    rows = bench.slot_rows(plains, tries, greedy=True)
    assert rows["ngram"]["constrained"]["decode_vs_plain"] == 1.8
    assert rows["plain"]["constrained"]["decode_vs_plain"] == 1.0
    assert "decode_vs_plain" not in rows["ngram"]["unconstrained"]  # plain's has no rate


def test_summary_tables_by_temperature_config_constraint_and_c(bench):
    def row(tps, valid, acc=None):
        return {"tok_per_s": tps, "speedup": tps / 100, "valid_fraction": valid,
                "accept_length": acc}  # fmt: skip

    runs = {
        "t0_c1": {"plain": {"unconstrained": row(100.0, 0.1), "constrained": row(90.0, 1.0)},
                  "eagle3": {"constrained": {**row(200.0, 1.0, 3.1), "tokens_per_step": 1.7}}},
        "t0_c16": {"plain": {"unconstrained": row(1000.0, 0.2)}},
        "t0.8_c1": {"plain": {"constrained": row(80.0, 1.0)}},
    }  # fmt: skip
    out = bench.summary_tables(runs)
    assert out["tok_per_s"]["0"]["plain"] == {
        "unconstrained": {"1": 100.0, "16": 1000.0},
        "constrained": {"1": 90.0},
    }
    assert out["tok_per_s"]["0.8"] == {"plain": {"constrained": {"1": 80.0}}}
    assert out["valid_fraction"]["0"]["eagle3"] == {"constrained": {"1": 1.0}}
    assert out["accept_length"] == {"0": {"eagle3": {"constrained": {"1": 3.1}}}}
    assert out["tokens_per_step"] == {"0": {"eagle3": {"constrained": {"1": 1.7}}}}
    assert json.loads(json.dumps(out)) == out


def test_configs_are_spec_gpus_chains_and_tree(bench):
    specs = bench.engine_configs(4, None)
    assert list(specs) == list(bench.CONFIGS)
    assert specs["eagle3_tree"]["topk"] > 1 and specs["eagle3_tree"]["controller"] == "fixed"
    assert specs["plain"] is None
    assert specs["ngram"] == {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"}
    assert specs["eagle3"]["method"] == "eagle3" and specs["eagle3"]["num_draft_tokens"] == 4
    assert specs["eagle3"].get("topk", 1) == 1
    for name in ("ngram", "eagle3"):  # the twin differs only in grammar drafts
        assert specs[f"{name}_nogd"] == {**specs[name], "grammar_drafts": False}
        assert specs[name].get("grammar_drafts", True)
    assert specs["plain_nogd"] == {"grammar_drafts": False}  # a forced token a step


# -- end to end on the CPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama whose byte-level BPE holds every byte (any JSON can be spelled) and
    a chat template, saved as an HF directory."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.tiny import hf_reference, tiny_hf_config

    path = tmp_path_factory.mktemp("tiny-structured")
    hf_reference(tiny_hf_config("LlamaForCausalLM")).save_pretrained(path, safe_serialization=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ['{"name": "Al", "age": 30, "ok": true} 2024-01-31 happy sad yes no'] * 8
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    return path


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model_every_constrained_output_is_valid(
    bench, tiny_model, tmp_path, monkeypatch
):
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}  # fmt: skip
    case_file = tmp_path / "cases.json"
    case_file.write_text(json.dumps({
        "schemas": [{"name": "flag", "schema": flag, "prompt": "ok?", "example": {"ok": True}}],
        "regex": [{"name": "date", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}", "prompt": "date?",
                   "example": "2024-01-31"}],
        "choice": [{"name": "mood", "choice": ["happy", "sad"], "prompt": "mood?",
                    "example": "sad"}],
    }))  # fmt: skip
    argv = ["structured.py", "--device", "cpu", "--dtype", "float32", "--model", str(tiny_model),
            "--configs", "ngram", "--concurrency", "1", "3", "--temperatures", "0", "0.8",
            "--max-tokens", "32", "--cases", str(case_file), "--out-dir", str(tmp_path),
            "--plot", str(tmp_path / "s.png")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads((tmp_path / "structured_cpu.json").read_text())
    for key in ("command", "commit", "machine", "versions"):
        assert key in result, key
    assert result["min_batches"] == 1  # the CPU's default
    cost = result["compile_cost"]
    # The first validate builds the engine's llguidance tokenizer too; a cached one compiles
    # nothing.
    assert cost["first_validate_ms"] > cost["cached_validate_ms"] > 0
    assert [r["case"] for r in cost["fresh_validate_ms"]] == ["date", "mood"]
    assert cost["first_token_request"]["case"] == "mood"  # the set holds no fourth case
    assert (tmp_path / "s.png").stat().st_size > 0
    assert set(result["runs"]) == {"t0_c1", "t0_c3", "t0.8_c1", "t0.8_c3"}
    for key, rows in result["runs"].items():
        assert {c: set(r) for c, r in rows.items()} == {
            "plain": {"unconstrained", "constrained", "matched"},
            "ngram": {"unconstrained", "constrained"},
        }, key
        # Plain matched makes exactly the tokens plain constrained made, unconstrained.
        matched, fixed = rows["plain"]["matched"], rows["plain"]["constrained"]
        assert matched["tokens"] == fixed["tokens"] and matched["valid_fraction"] < 1, key
        want = round(fixed["tok_per_s"] / matched["tok_per_s"], 3)
        assert fixed["vs_plain_matched"] == want, key
        assert rows["ngram"]["constrained"]["vs_plain_matched"] > 0, key
        for cfg, by_constraint in rows.items():
            row = by_constraint["constrained"]
            # The regex and the choice end well inside 32 tokens; whatever ended, is valid.
            enforced = f"{key} {cfg}: is structured_outputs enforced? {row}"
            assert row["finished_fraction"] >= 2 / 3, enforced
            assert row["valid_fraction_finished"] == 1.0, enforced
        if key.startswith("t0_"):
            # Greedy n-gram verification keeps plain's tokens, constrained or not (fp32).
            assert rows["ngram"]["constrained"]["same_output_fraction"] == 1.0, key
            assert rows["ngram"]["unconstrained"]["same_output_fraction"] == 1.0, key
            # The grammar forces the schema's keys and punctuation: they ride as drafts.
            assert rows["ngram"]["constrained"]["spec_stats"]["num_forced_drafts"] > 0, key
