"""vLLM's and SGLang's spellings of engine settings (flags, YAML keys, the Python API) reach the
same configs as outrider's own; the README's table is the list of aliases, checked row by row."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from outrider.cli import build_parser
from outrider.config import EngineConfig, SpecConfig, flat_sections
from outrider.flags import sglang_speculative
from outrider.server.cli import configs_from_args
from outrider.server.config import load_yaml

README = Path(__file__).resolve().parents[2] / "README.md"


def _table_rows() -> list[tuple[str, str, str]]:
    text = README.read_text()
    table = text.split("<!-- dialect-table -->")[1].split("<!-- /dialect-table -->")[0]
    rows = []
    for line in table.strip().splitlines()[2:]:  # past the header and the rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]  # no cell holds a |
        code = [re.findall(r"`([^`]*)`", c) for c in cells]
        rows.append(tuple(found[0] if found else "" for found in code))
    return rows


ROWS = _table_rows()


def _serve(argv: str):
    return configs_from_args(build_parser().parse_args(shlex.split(argv)))


def _yaml(text: str, tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    return load_yaml(path)


def test_the_readme_table_has_rows():
    assert len(ROWS) >= 10
    assert all(row[0].startswith("serve") and row[2] for row in ROWS), ROWS


@pytest.mark.parametrize("alias,native,yaml_text", ROWS, ids=[r[0][:60] for r in ROWS])
def test_every_alias_in_the_readme_reaches_the_native_config(alias, native, yaml_text, tmp_path):
    got = _serve(alias)
    assert got == _yaml(yaml_text, tmp_path)
    if native:
        assert got == _serve(native)
    assert got != _serve("serve --max-num-seqs 3")  # the comparison can fail


def test_a_flag_given_at_its_default_wins_over_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler: {max_num_seqs: 32}\nmodel: {dtype: bfloat16}\n")
    _, engine = _serve(f"serve --config {path} --max-num-seqs 64 --dtype auto")
    assert engine.scheduler.max_num_seqs == 64  # 64 is the default: given, it still wins
    assert engine.model.dtype == "auto"


def test_a_yaml_model_line_is_the_model_path(tmp_path):
    engine = EngineConfig.from_dict(yaml.safe_load("model: /srv/m.gguf\nmax-num-seqs: 8"))
    assert engine.model.model == "/srv/m.gguf"
    assert engine.scheduler.max_num_seqs == 8


@pytest.mark.parametrize("spelling", ["EAGLE3", "eagle3", "Eagle-3", "eagle_3"])
def test_method_names_in_any_case(spelling):
    assert SpecConfig(**SpecConfig.normalize({"method": spelling})).method == "eagle3"
    _, engine = _serve(f"serve --spec {spelling}")
    assert engine.speculative.method == "eagle3"
    assert EngineConfig().replace(speculative={"method": spelling}).speculative.method == "eagle3"


def test_unknown_keys_name_their_close_matches():
    with pytest.raises(ValueError, match="'max_num_seq' -> 'max_num_seqs'"):
        EngineConfig.from_dict({"max_num_seq": 3})
    with pytest.raises(ValueError, match="'num_draft_token' -> 'num_draft_tokens'"):
        EngineConfig.from_dict({"speculative": {"num_draft_token": 3}})
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig.from_dict({"scheduler": {"max_num_seqs": 3}, "max_num_seqs": 4})


@pytest.mark.parametrize(
    "values,match",
    [
        ({"speculative_config": "{not json"}, "not JSON"),
        ({"speculative_config": {"method": "medusa"}}, "not supported: use eagle3"),
    ],
)
def test_vllm_values_outrider_cannot_honour_are_clear_errors(values, match):
    with pytest.raises(ValueError, match=match):
        flat_sections(values)


def test_speculative_config_json_text_equals_the_mapping():
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    assert flat_sections({"speculative_config": json.dumps(spec)}) == flat_sections(
        {"speculative_config": spec}
    )
    assert flat_sections({"speculative_config": spec})["speculative"] == {
        "method": "ngram", "num_draft_tokens": 2, "ngram_min_n": 2,
    }  # fmt: skip


def test_sglang_counts_the_root_token():
    assert sglang_speculative({"num_draft_tokens": 4, "topk": 3, "num_steps": 3}) == {
        "num_draft_tokens": 3, "topk": 3, "num_steps": 3,
    }  # fmt: skip
    with pytest.raises(ValueError, match="needs num-draft-tokens 4"):
        sglang_speculative({"num_steps": 3, "num_draft_tokens": 5})  # a chain of 3 drafts 3
    with pytest.raises(ValueError, match="at least 2"):
        sglang_speculative({"num_draft_tokens": 1})


def test_sglang_and_outrider_draft_counts_together_warn_and_outrider_wins(caplog):
    _, engine = _serve("serve --spec eagle3 --speculative-num-draft-tokens 5 --num-draft-tokens 2")
    assert engine.speculative.num_draft_tokens == 2
    assert "outrider's win" in caplog.text


def test_positional_model_and_a_different_model_flag_conflict():
    assert _serve("serve a.gguf")[1].model.model == "a.gguf"
    assert _serve("serve a.gguf --model a.gguf")[1].model.model == "a.gguf"
    with pytest.raises(ValueError, match="two models given"):
        _serve("serve a.gguf --model b.gguf")


def test_llm_options_take_vllm_names(monkeypatch):
    """LLM() builds its config through the same translation (the engine itself is not built:
    EngineCore is replaced by a recorder)."""
    import outrider.llm as llm_module

    seen = {}

    class Recorder:
        def __init__(self, config):
            seen["config"] = config
            self.tokenizer = None

    monkeypatch.setattr(llm_module, "EngineCore", Recorder)
    llm_module.LLM(
        "m.gguf",
        speculative_config={"method": "EAGLE3", "model": "d", "num_speculative_tokens": 3},
        enforce_eager=True, tensor_parallel_size=1, max_num_seqs=8,
    )  # fmt: skip
    config = seen["config"]
    assert (config.speculative.method, config.speculative.draft) == ("eagle3", "d")
    assert config.speculative.num_draft_tokens == 3
    assert config.model.cuda_graphs is False and config.scheduler.max_num_seqs == 8
    with pytest.raises(TypeError, match="max_num_seq.*max_num_seqs"):
        llm_module.LLM(max_num_seq=8)
    with pytest.raises(TypeError, match="both speculative and speculative_config"):
        llm_module.LLM(speculative={}, speculative_config={})


def test_hf_repo_ids_load_from_the_local_cache(tmp_path, monkeypatch):
    from outrider.loaders.checkpoint import hf_cache_snapshot, is_repo_id, open_checkpoint

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert is_repo_id("org/name") and is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not any(map(is_repo_id, ["./org/name", "/org/name", "a/b/c", "org/m.gguf", "x"]))
    with pytest.raises(FileNotFoundError, match="neither a local path nor in the Hugging Face"):
        open_checkpoint("org/name")
    snap = tmp_path / "models--org--name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("abc123\n")
    assert hf_cache_snapshot("org/name") == snap
    with pytest.raises(ValueError, match="directory without config.json"):
        open_checkpoint("org/name")  # resolved to the snapshot, which holds no model here


@pytest.mark.slow
def test_n_completions_per_prompt_in_the_python_api():
    """SamplingParams(n=...) gives RequestOutput.outputs[i] (vLLM's shape): seeded completion i
    samples as a request seeded seed + i would, and n=1 keeps today's fields as outputs[0]."""
    from outrider import LLM, SamplingParams

    llm = LLM(num_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8, n=3)
    out = llm.generate("Once upon a time", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    one = SamplingParams(temperature=1.0, seed=12, max_tokens=8)
    alone = llm.generate("Once upon a time", one)[0]
    assert out.outputs[1].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # three seeds, not one sample
    assert alone.outputs[0].text == alone.text and len(alone.outputs) == 1
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one completion"):
        next(llm.stream("x", params))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_config_field_has_a_flag(command):
    """The flags are generated from the config dataclasses: a field added there is settable
    from the command line without a line here (generate's --seed is the sampling seed)."""
    import dataclasses

    from outrider.config import SECTIONS

    parser = build_parser()
    argv = [command, "--help"]
    with pytest.raises(SystemExit):
        parser.parse_args(argv)  # fills the command's flags (they load on first use)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    dests = {a.dest for a in sub._actions}
    fields = {f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)}
    missing = fields - dests - ({"model.seed"} if command == "generate" else set())
    assert not missing, missing
    _, engine = _serve(
        "serve --ngram-max-n 6 --no-enable-chunked-prefill --attention-backend torch_ref"
    )
    assert engine.speculative.ngram_max_n == 6 and not engine.scheduler.enable_chunked_prefill
