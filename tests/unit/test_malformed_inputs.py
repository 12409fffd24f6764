"""Every malformed config value, flag value or YAML file a user can give `outrider generate` and
`outrider serve` exits with status 2 and one message naming the key and quoting the bad value
(and the file, for YAML), never a traceback. No model loads: each case fails while the configs
are built, and stand-ins for the LLM and the server fail the test if one ever gets that far."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from outrider.cli import build_parser, main
from outrider.flags import engine_config

# (name, argv, YAML text or None, what stderr must contain). "{yaml}" in argv and in the
# expected texts is the YAML file's path.
CASES = [
    # -- wrong kinds in an engine YAML --------------------------------------------------------
    ("yaml str for int", ["generate", "--config", "{yaml}", "x"], 'max_num_seqs: "lots"\n',
     ["{yaml}", "max_num_seqs", "'lots'", "integer"]),
    ("yaml bool for int", ["generate", "--config", "{yaml}", "x"], "cache: {block_size: true}\n",
     ["{yaml}", "block_size", "True", "integer"]),
    ("yaml str for float", ["generate", "--config", "{yaml}", "x"],
     "gpu_memory_utilization: high\n", ["{yaml}", "gpu_memory_utilization", "'high'", "number"]),
    ("yaml str for spec int", ["generate", "--config", "{yaml}", "x"],
     "speculative: {method: ngram, num_draft_tokens: four}\n",
     ["{yaml}", "num_draft_tokens", "'four'"]),
    ("yaml str for bool", ["generate", "--config", "{yaml}", "x"],
     "enable_prefix_caching: 'yes'\n",
     ["{yaml}", "enable_prefix_caching", "'yes'", "true or false"]),
    ("yaml list for str", ["generate", "--config", "{yaml}", "x"], "dtype: [float32]\n",
     ["{yaml}", "dtype", "['float32']"]),
    ("yaml str for tp", ["generate", "--config", "{yaml}", "x"], "tensor_parallel_size: two\n",
     ["{yaml}", "tensor_parallel_size", "'two'"]),
    ("yaml byte suffix", ["generate", "--config", "{yaml}", "x"], "cpu_kv_bytes: 4G\n",
     ["{yaml}", "cpu_kv_bytes", "'4G'"]),
    ("yaml float for int", ["generate", "--config", "{yaml}", "x"], "max_model_len: 1.5\n",
     ["{yaml}", "max_model_len", "1.5"]),
    # -- values out of range in an engine YAML ------------------------------------------------
    ("yaml zero seqs", ["generate", "--config", "{yaml}", "x"], "max_num_seqs: 0\n",
     ["{yaml}", "max_num_seqs=0"]),
    ("yaml negative tokens", ["generate", "--config", "{yaml}", "x"],
     "scheduler: {max_num_batched_tokens: -5}\n", ["{yaml}", "max_num_batched_tokens=-5"]),
    ("yaml utilization 1.5", ["generate", "--config", "{yaml}", "x"],
     "cache: {gpu_memory_utilization: 1.5}\n", ["{yaml}", "gpu_memory_utilization=1.5"]),
    ("yaml block not power of 2", ["generate", "--config", "{yaml}", "x"], "block_size: 12\n",
     ["{yaml}", "block_size=12"]),
    # -- unknown keys, bad shapes, bad files --------------------------------------------------
    ("yaml unknown flat key", ["generate", "--config", "{yaml}", "x"], "max_num_seq: 3\n",
     ["{yaml}", "'max_num_seq'", "did you mean", "'max_num_seqs'"]),
    ("yaml unknown section key", ["generate", "--config", "{yaml}", "x"],
     "scheduler: {max_num_seq: 3}\n", ["{yaml}", "'max_num_seq'", "did you mean"]),
    ("yaml unknown vllm spec key", ["generate", "--config", "{yaml}", "x"],
     "speculative: {method: ngram, num_speculative_token: 3}\n",
     ["{yaml}", "'num_speculative_token'", "did you mean", "'num_speculative_tokens'"]),
    ("yaml sampling key", ["generate", "--config", "{yaml}", "x"], "temperature: 0.5\n",
     ["{yaml}", "'temperature'"]),
    ("yaml section not mapping", ["generate", "--config", "{yaml}", "x"], "scheduler: 5\n",
     ["{yaml}", "'scheduler'", "got 5"]),
    ("yaml syntax: unclosed", ["generate", "--config", "{yaml}", "x"], "model: {dtype: [\n",
     ["{yaml}", "not valid YAML", "line 2"]),
    ("yaml syntax: indent", ["serve", "--config", "{yaml}"], "port: 8000\n  bad: x: y\n",
     ["{yaml}", "not valid YAML", "line 2"]),
    ("yaml list", ["serve", "--config", "{yaml}"], "- max_num_seqs\n- 4\n",
     ["{yaml}", "mapping", "list", "'max_num_seqs'"]),
    ("yaml scalar", ["generate", "--config", "{yaml}", "x"], "max_num_seqs\n",
     ["{yaml}", "mapping", "'max_num_seqs'"]),
    ("yaml missing", ["generate", "--config", "{yaml}.missing", "x"], None,
     ["{yaml}.missing", "not found"]),
    # -- the server's YAML ---------------------------------------------------------------------
    ("server str port", ["serve", "--config", "{yaml}"], "port: eighty\n",
     ["{yaml}", "port", "'eighty'", "integer"]),
    ("server port range", ["serve", "--config", "{yaml}"], "server: {port: 70000}\n",
     ["{yaml}", "port=70000"]),
    ("server zero n", ["serve", "--config", "{yaml}"], "server: {max_n: 0}\n",
     ["{yaml}", "max_n=0"]),
    ("server zero template time", ["serve", "--chat-template-timeout-s", "0"], None,
     ["chat_template_timeout_s=0"]),
    ("server str template chars", ["serve", "--config", "{yaml}"],
     "server: {chat_template_max_chars: lots}\n", ["{yaml}", "chat_template_max_chars", "'lots'"]),
    ("server str timeout", ["serve", "--config", "{yaml}"], "server: {shutdown_timeout: soon}\n",
     ["{yaml}", "shutdown_timeout", "'soon'"]),
    ("server origins not list", ["serve", "--config", "{yaml}"], "server: {cors_origins: 5}\n",
     ["{yaml}", "cors_origins", "5", "list"]),
    ("server section not mapping", ["serve", "--config", "{yaml}"], "server: 5\n",
     ["{yaml}", "'server'", "got 5"]),
    ("server unknown key", ["serve", "--config", "{yaml}"], "prot: 8000\n",
     ["{yaml}", "'prot'", "did you mean", "'port'"]),
    ("server engine str", ["serve", "--config", "{yaml}"], "server: {port: 0}\nblock_size: big\n",
     ["{yaml}", "block_size", "'big'"]),
    ("server flag over yaml", ["serve", "--config", "{yaml}", "--max-n", "0"], "port: 0\n",
     ["max_n=0"]),
    # -- flags ----------------------------------------------------------------------------------
    ("flag str for int", ["generate", "--max-num-seqs", "lots", "x"], None,
     ["--max-num-seqs", "'lots'"]),
    ("flag str for float", ["generate", "--temperature", "hot", "x"], None,
     ["--temperature", "'hot'"]),
    ("flag utilization 1.5", ["generate", "--gpu-memory-utilization", "1.5", "x"], None,
     ["gpu_memory_utilization=1.5"]),
    ("flag zero block", ["generate", "--block-size", "0", "x"], None, ["block_size=0"]),
    ("flag negative tp", ["generate", "-tp", "-1", "x"], None, ["tensor_parallel_size=-1"]),
    ("flag bad bytes", ["generate", "--cpu-kv-bytes", "lots", "x"], None,
     ["--cpu-kv-bytes", "'lots'"]),
    ("flag serve port", ["serve", "--port", "eighty"], None, ["--port", "'eighty'"]),
    # -- vLLM's --speculative-config -------------------------------------------------------------
    ("spec not json", ["generate", "--speculative-config", "{num_speculative_tokens: 3", "x"],
     None, ["speculative_config", "'{num_speculative_tokens: 3'", "not JSON"]),
    ("spec not object", ["generate", "--speculative-config", "[1, 2]", "x"], None,
     ["speculative_config", "[1, 2]", "mapping"]),
    ("spec str for int",
     ["generate", "--speculative-config", '{"num_speculative_tokens": "four"}', "x"], None,
     ["num_speculative_tokens", "'four'", "integer"]),
    ("spec bool for int",
     ["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": true}',
      "x"], None, ["num_speculative_tokens", "True", "integer"]),
    ("spec list for str",
     ["generate", "--speculative-config", '{"method": "eagle3", "model": ["d"]}', "x"], None,
     ["model", "['d']", "string"]),
    ("spec unknown key",
     ["generate", "--speculative-config", '{"num_speculative_token": 4}', "x"], None,
     ["'num_speculative_token'", "did you mean", "'num_speculative_tokens'"]),
    ("spec unsupported method", ["generate", "--speculative-config", '{"method": "medusa"}', "x"],
     None, ["'medusa'", "not supported"]),
    ("spec and --spec disagree",
     ["generate", "--spec", "eagle3", "--speculative-config", '{"method": "ngram"}', "x"], None,
     ["--spec eagle3", "'method'", "'ngram'", "disagree"]),
    ("spec and -k disagree",
     ["generate", "--num-draft-tokens", "2", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 3}', "x"], None,
     ["--num-draft-tokens 2", "'num_speculative_tokens'", "3", "disagree"]),
]  # fmt: skip


@pytest.fixture
def no_model(monkeypatch):
    """Stand-ins for what a command imports once its configs are built: a case that gets that
    far fails here instead of loading a model or starting a server."""

    def refuse(*args, **kwargs):
        raise AssertionError("the configs were accepted: this input is not malformed")

    monkeypatch.setitem(sys.modules, "outrider.llm", types.SimpleNamespace(LLM=refuse))
    monkeypatch.setitem(sys.modules, "outrider.server.server", types.SimpleNamespace(serve=refuse))


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors
        return e.code


@pytest.mark.parametrize(
    ("argv", "text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_input_exits_2_naming_key_and_value(
    argv, text, expected, tmp_path, capsys, no_model
):
    path = str(tmp_path / "config.yaml")
    if text is not None:
        (tmp_path / "config.yaml").write_text(text)
    rc = run_cli([a.replace("{yaml}", path) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert "Traceback" not in out + err
    for want in expected:
        assert want.replace("{yaml}", path) in err, (want, err)


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize(
    "spec",
    ['{"method": "ngram", "num_speculative_tokens": 3}', '{"num_speculative_tokens": 3}'],
)
def test_spec_flag_merges_with_speculative_config_that_agrees(spec):
    args = build_parser().parse_args(
        ["generate", "--spec", "ngram", "--speculative-config", spec, "x"]
    )
    config = engine_config(args)
    assert (config.speculative.method, config.speculative.num_draft_tokens) == ("ngram", 3)


def test_yaml_lists_and_paths_still_taken(tmp_path):
    """The kind checks convert where YAML or Python give another spelling of the same thing."""
    from pathlib import Path

    from outrider.config import EngineConfig
    from outrider.server.config import load_yaml

    cfg = tmp_path / "s.yaml"
    cfg.write_text("server: {cors_origins: [https://a.example]}\ngpu_memory_utilization: 1\n")
    server, engine = load_yaml(cfg)
    assert server.cors_origins == ("https://a.example",)
    assert engine.cache.gpu_memory_utilization == 1
    assert EngineConfig().replace(model={"model": Path("/m.gguf")}).model.model == "/m.gguf"


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["generate", "--config", "{yaml}", "x"], 'max_num_seqs: "lots"\n'),
        (["serve", "--config", "{yaml}"], "model: {dtype: [\n"),
    ],
)
def test_the_process_exits_2_without_a_traceback(argv, text, tmp_path):
    """The real command, once per kind of failure: no handler above main() turns it into 1."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    argv = [a.replace("{yaml}", str(cfg)) for a in argv]
    r = subprocess.run(
        [sys.executable, "-m", "outrider", *argv], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert str(cfg) in r.stderr
